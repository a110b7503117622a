"""Metric sinks for the trainer: DVCLive files (for `dvc metrics` / `dvc plots`) and the console."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

# The metrics worth a glance on the progress line; everything goes to DVCLive.
HEADLINE = {
    "rollout/score": "score",
    "rollout/kl": "kl",
    "ppo/approx_kl": "approx_kl",
    "ppo/clipfrac": "clip",
    "rollout/eos_rate": "eos",
    "perf/tokens_per_s": "tok/s",
}


class DVCLiveLogger:
    """Writes every metric per iteration under ``folder`` with DVCLive (``plots/metrics/...`` and
    ``metrics.json``). The folder is rewritten from the run's full history on resume, so it always
    describes the whole run."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.live = None  # opened at the first metrics, so a run that fails to start keeps the old files

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        if self.live is None:
            from dvclive import Live

            self.live = Live(dir=str(self.folder), resume=False, save_dvc_exp=False, dvcyaml=None,
                             report=None)
        self.live.step = iteration
        for name, value in metrics.items():
            self.live.log_metric(name, value, plot=True)
        self.live.make_summary()

    def close(self) -> None:
        if self.live is not None:
            self.live.end()


class ConsoleProgress:
    """A progress bar with the headline metrics of the last iteration."""

    def __init__(self, total: int, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]PPO"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[line]}"), console=self.console, transient=False,
        )
        self.task = self.progress.add_task("train", total=total, line="")
        self.started = False

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        if not self.started:
            self.progress.start()
            self.started = True
        line = "  ".join(
            f"{short} {metrics[key]:.3g}" for key, short in HEADLINE.items() if key in metrics
        )
        self.progress.update(self.task, completed=iteration, line=line)

    def close(self) -> None:
        if self.started:
            self.progress.stop()
