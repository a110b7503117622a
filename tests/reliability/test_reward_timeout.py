"""A reward that never returns: training stops with one clear error within the timeout
(``model.reward_timeout``), writes nothing, releases its lock, and the process exits although the
hung call is still running in its thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ppo_core.config import load_config
from ppo_core.files import exclusive_run
from ppo_core.rewards.loading import RewardError
from ppo_core.training.loop import train

ROOT = Path(__file__).resolve().parents[2]
HANGING = "tests.reliability.test_reward_timeout:hanging_reward"

# hanging_reward waits on RELEASE so that a test can end the hung call once it has checked what
# it needed; in a subprocess nothing sets it and the call would outlast the process by an hour.
RELEASE = threading.Event()
ENTERED: list[float] = []


def hanging_reward(prompts, responses):
    ENTERED.append(time.monotonic())
    RELEASE.wait(3600)
    return [0.0] * len(prompts)


def overrides(tmp: Path, model: Path, prompts: tuple[Path, Path], *extra: str) -> list[str]:
    return [
        f"model.policy={model}",
        f"data.train_file={prompts[0]}",
        f"train.output_dir={tmp / 'candidate'}",
        f"train.checkpoint_dir={tmp / 'checkpoints'}",
        f"train.metrics_dir={tmp / 'metrics'}",
        "ppo.rollout_batch_size=8",
        "ppo.mini_batch_size=8",
        "ppo.micro_batch_size=8",
        "ppo.epochs=1",
        "generation.max_new_tokens=4",
        "train.iterations=2",
        "train.checkpoint_every=1",
        f"model.reward={HANGING}",
        *extra,
    ]


@pytest.fixture
def release_hung_calls():
    RELEASE.clear()
    ENTERED.clear()
    yield
    RELEASE.set()  # ends the thread left waiting, so it does not outlive the test


def test_a_hanging_reward_stops_training_within_the_timeout(
    tmp_path, tiny_model_dir, prompt_files, release_hung_calls
):
    config = load_config(
        overrides=overrides(tmp_path, tiny_model_dir, prompt_files, "model.reward_timeout=1")
    )
    with pytest.raises(RewardError) as caught:
        train(config)
    stopped = time.monotonic()
    message = str(caught.value)
    assert "\n" not in message
    assert repr(HANGING) in message
    assert "1 s" in message and "model.reward_timeout" in message
    # One call entered, the error came about a second later although the call never returned.
    assert len(ENTERED) == 1 and not RELEASE.is_set()
    assert 1.0 <= stopped - ENTERED[0] < 10.0
    assert not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "candidate").exists()
    # The run lock was released: the next scheduled run can start.
    with exclusive_run(tmp_path / ".checkpoints.lock", "training run"):
        pass


def test_the_cli_exits_with_one_line_while_the_reward_still_hangs(
    tmp_path, tiny_model_dir, prompt_files
):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "--quiet",
        "threads=1",
        *overrides(tmp_path, tiny_model_dir, prompt_files, "model.reward_timeout=1"),
    ]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired:  # pragma: no cover - the failure this test guards against
        pytest.fail("ppo train did not exit: the hung reward kept the process alive")
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    [line] = [x for x in output.splitlines() if x.startswith("error:")]
    assert HANGING in line and "model.reward_timeout" in line
    assert time.monotonic() - started < 240
    assert not (tmp_path / "candidate").exists()
