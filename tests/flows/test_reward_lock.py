"""``ppo reward`` (and so ``dvc repro reward``) takes the project's retraining lock, as runs of
the flow and ``ppo rollback`` do: a reward rollback cannot land while a reward model trains
and then be undone by its decision. Under a run of the flow, which holds the lock and runs the
stage through ``dvc repro``, the stage runs under the run's lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flows.orchestration.project import RETRAIN_LOCK, RETRAIN_LOCK_HOLDER
from ppo_core.files import exclusive_run

PPO = Path(sys.executable).parent / "ppo"
HOLD = (
    "import time\n"
    "from ppo_core.files import exclusive_run\n"
    f"with exclusive_run({RETRAIN_LOCK!r}, {RETRAIN_LOCK_HOLDER!r}):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(120)\n"
)
MISSING = "data/prepared/feedback/manifest.json is missing"


def reward(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PPO), "reward", "--config", "none"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ppo_reward_is_refused_while_another_process_holds_the_retraining_lock(tmp_path):
    """Seen failing without the lock: the stage went on to read its data."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        refused = reward(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"another {RETRAIN_LOCK_HOLDER} is running" in refused.stderr
    assert MISSING not in refused.stderr


def test_under_a_run_that_holds_the_lock_the_stage_runs(tmp_path):
    """This process holds the lock, as a run of the flow does, and runs the stage as its child
    (the flow's `dvc repro` does): the stage goes on, to the missing data here."""
    with exclusive_run(tmp_path / RETRAIN_LOCK, RETRAIN_LOCK_HOLDER):
        under_run = reward(tmp_path)
    assert MISSING in under_run.stderr, under_run.stdout + under_run.stderr
    alone = reward(tmp_path)  # and with nobody holding it, the stage takes it itself
    assert MISSING in alone.stderr
