"""Metric names and files: DVCLive keeps each metric where metric_file says."""

from __future__ import annotations

import json

from flows.loggers import DVCLiveLogger, metric_file


def test_dvclive_writes_each_metric_where_metric_file_says(tmp_path):
    folder = tmp_path / "train"
    logger = DVCLiveLogger(folder)
    logger.log(1, {"rollout/score": 0.5, "ppo/approx_kl": 0.01})
    logger.log(2, {"rollout/score": 0.75, "ppo/approx_kl": 0.02})
    logger.close()
    assert metric_file(folder, "rollout/score").read_text().splitlines() == [
        "step\tscore",
        "1\t0.5",
        "2\t0.75",
    ]
    assert metric_file(folder, "ppo/approx_kl").is_file()
    summary = json.loads((folder / "metrics.json").read_text())
    assert summary["rollout"]["score"] == 0.75 and summary["step"] == 2


def test_wall_clock_timings_stay_out_of_the_dvclive_files(tmp_path):
    """The DVCLive files are outputs of the train stage (their hashes are in dvc.lock): the
    ``perf/`` timings, which differ on every run, go to ``timings.json`` beside them instead."""
    folder = tmp_path / "train"
    logger = DVCLiveLogger(folder)
    logger.log(1, {"rollout/score": 0.5, "perf/rollout_s": 1.5, "perf/tokens_per_s": 40.0})
    logger.log(2, {"rollout/score": 0.75, "perf/rollout_s": 1.25, "perf/tokens_per_s": 48.0})
    logger.close()
    assert "perf" not in json.loads((folder / "metrics.json").read_text())
    assert not metric_file(folder, "perf/rollout_s").exists()
    timings = json.loads((folder / "timings.json").read_text())
    assert timings == {"perf": {"rollout_s": 1.25, "tokens_per_s": 48.0}}


def test_progress_in_a_log_is_a_plain_line_every_tenth_of_the_run():
    """Under DVC run by the Prefect flow, stderr is a pipe: a bar would come out as one block at
    the end, so the progress is a line every tenth of the run, streamed as it happens."""
    import io

    from rich.console import Console

    from flows.loggers import ConsoleProgress

    out = io.StringIO()
    progress = ConsoleProgress(20, console=Console(file=out, force_terminal=False))
    for iteration in range(1, 21):
        progress.log(iteration, {"rollout/score": 0.5, "rollout/kl": 1.25})
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "PPO iteration 2/20  score 0.5  kl 1.25"
    assert [line.split()[2] for line in lines] == [f"{i}/20" for i in range(2, 21, 2)]
