"""Metric names and sinks: DVCLive files (for `dvc metrics` / `dvc plots`) and the console.

A metric is named ``group/name`` (``rollout/score``, ``ppo/approx_kl``, ``candidate/score``).
:func:`metric_file` says where DVCLive keeps one metric's series (``dvc.yaml``'s plot paths are
checked against it by the tests); ``ppo_core.files.artifacts.metric_group`` reads one group of a
flat mapping. DVCLive and the trainer's names
are imported where a run logs, so that the stages that only read metrics import neither.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ppo_core.files import atomic_write_text, remove_links

if TYPE_CHECKING:
    from dvclive import Live

# The metrics worth a glance on the progress line; everything goes to DVCLive.
HEADLINE = {
    "rollout/score": "score",
    "rollout/kl": "kl",
    "ppo/approx_kl": "approx_kl",
    "ppo/clipfrac": "clip",
    "rollout/eos_rate": "eos",
    "perf/tokens_per_s": "tok/s",
}


def metric_file(folder: str | Path, key: str) -> Path:
    """The file in which :class:`DVCLiveLogger` (DVCLive) keeps the per-iteration values of the
    metric ``key`` logged under ``folder``: ``plots/metrics/rollout/score.tsv`` for
    ``rollout/score``, a ``step`` column and one named after the key's last part. The folder's
    ``metrics.json`` holds the latest values, nested by the same parts."""
    return Path(folder) / "plots" / "metrics" / f"{key}.tsv"


TIMINGS_FILE = "timings.json"


class DVCLiveLogger:
    """Writes every metric per iteration under ``folder`` with DVCLive (:func:`metric_file` and
    ``metrics.json``). The folder is rewritten from the run's full history on resume, so it always
    describes the whole run.

    Wall-clock measurements (``perf/...``) go to ``timings.json`` beside it instead (the latest
    iteration's, nested like ``metrics.json``): the DVCLive files are outputs of the train stage,
    recorded in ``dvc.lock``, and must be the same bytes when the same inputs are run again;
    ``timings.json`` is listed under ``dvc.yaml``'s top-level ``metrics`` only, so that
    ``dvc metrics show`` and ``dvc exp show`` still show it."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        # Opened at the first metrics, so a run that fails to start keeps the old files.
        self.live: Live | None = None

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        if self.live is None:
            from dvclive import Live

            # DVCLive cleans up and writes inside the folder, matplotlib writes curves.png there:
            # a link planted inside would take those deletions and writes where it points.
            for link in remove_links(self.folder):
                warnings.warn(
                    f"removed the symbolic link {self.folder / link} from the output folder "
                    f"{self.folder}: outputs are written there as files",
                    stacklevel=2,
                )
            self.live = Live(
                dir=str(self.folder), resume=False, save_dvc_exp=False, dvcyaml=None, report=None
            )
        self.live.step = iteration
        from ppo_core.checkpoints.store import METRIC_NAME
        from ppo_core.training.loop import TIMINGS

        timings: dict[str, dict[str, float]] = {}
        for name, value in metrics.items():
            # The name becomes a path under the folder (metric_file): never "../x" or "/x".
            if not METRIC_NAME.fullmatch(name):
                raise ValueError(f"metric name {name[:40]!r} is not group/name in lowercase words")
            if name.startswith(TIMINGS):
                group, key = name.split("/", 1)
                timings.setdefault(group, {})[key] = value
            else:
                self.live.log_metric(name, value, plot=True)
        self.live.make_summary()
        if timings:
            atomic_write_text(self.folder / TIMINGS_FILE, json.dumps(timings, indent=1))

    def close(self) -> None:
        if self.live is not None:
            self.live.end()


def headline(metrics: Mapping[str, float]) -> str:
    """The metrics worth a glance, short-named: ``score 0.42  kl 1.3  ...``."""
    return "  ".join(
        f"{short} {metrics[key]:.3g}" for key, short in HEADLINE.items() if key in metrics
    )


class ConsoleProgress:
    """A progress bar with the headline metrics of the last iteration; where stderr is not a
    terminal (a log: DVC run by the Prefect flow, CI), a plain line every tenth of the run.
    ``label`` and ``unit`` name the work (``PPO`` iterations, ``reward model`` steps)."""

    def __init__(
        self,
        total: int,
        console: Console | None = None,
        label: str = "PPO",
        unit: str = "iteration",
    ):
        self.console = console or Console(stderr=True)
        self.total, self.label, self.unit = total, label, unit
        self.every = max(1, total // 10)
        self.started = False
        if not self.console.is_terminal:
            return
        self.progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[line]}"),
            console=self.console,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total, line="")

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        if not self.console.is_terminal:
            if iteration % self.every == 0 or iteration == self.total:
                self.console.print(
                    f"{self.label} {self.unit} {iteration}/{self.total}  {headline(metrics)}",
                    soft_wrap=True,
                    highlight=False,
                )
            return
        if not self.started:
            self.progress.start()
            self.started = True
        self.progress.update(self.task, completed=iteration, line=headline(metrics))

    def step(self, done: int, total: int) -> None:
        """``done`` of ``total`` steps, the total known only once the work starts."""
        if total != self.total:
            self.total, self.every = total, max(1, total // 10)
            if self.console.is_terminal:
                self.progress.update(self.task, total=total)
        self.log(done, {})

    def close(self) -> None:
        if self.started:
            self.progress.stop()
