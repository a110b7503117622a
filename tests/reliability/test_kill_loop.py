"""Crash anywhere: SIGKILL the training process at random moments, at least 20 times over one run,
resume after each kill, and end with the parameters of an uninterrupted run.

After every kill each checkpoint folder on disk must verify (checksums) and load
(``weights_only``); a killed writer may leave only hidden temporary folders, which the next run
removes. The final run must have resumed from the newest checkpoint written before the last kill
(``resumed_from`` in its ``training_summary.json``, and ``resumed at N`` on the console): a run
started over would reach the same parameters too, since training is deterministic, so equal
parameters alone would not show that anything resumed. ``PPO_KILLS`` sets the number of kills:
3 in `make test`, 20 in `make soak` (``PPO_SOAK=1``); the test prints what happened.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ppo_core.checkpoints.store import list_checkpoints, load_checkpoint_state

pytestmark = [pytest.mark.slow, pytest.mark.soak]

ROOT = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("PPO_KILLS", "20" if os.environ.get("PPO_SOAK") == "1" else "3"))
# A kill during training comes at most 0.15 s after a new checkpoint, so each adds one to three
# iterations; the run must outlast every kill, and the uninterrupted reference runs them all.
ITERATIONS = 8 * KILLS + 10


def command(model: Path, prompts: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "--quiet",
        f"model.policy={model}",
        f"data.train_file={prompts}",
        "threads=1",
        f"train.output_dir={out / 'candidate'}",
        f"train.checkpoint_dir={out / 'checkpoints'}",
        f"train.metrics_dir={out / 'metrics'}",
        f"train.iterations={ITERATIONS}",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=2",
        "ppo.rollout_batch_size=8",
        "ppo.mini_batch_size=4",
        "ppo.micro_batch_size=2",
        "ppo.epochs=1",
        "generation.max_new_tokens=6",
    ]


def newest_step(checkpoints: Path) -> int:
    found = list_checkpoints(checkpoints)
    return int(found[-1].name.split("-")[1]) if found else 0


def check_every_checkpoint(checkpoints: Path) -> int:
    """Every visible checkpoint verifies and loads; returns how many there are."""
    found = list_checkpoints(checkpoints)
    for folder in found:
        load_checkpoint_state(folder)  # raises on a missing, truncated or changed file
        assert (folder / "model" / "model.safetensors").is_file()
    return len(found)


def final_parameters(out: Path) -> dict[str, torch.Tensor]:
    folder = out / "candidate"
    weights = load_file(str(folder / "model.safetensors"))
    weights.update(load_file(str(folder / "value_head.safetensors")))
    return weights


def test_sigkill_at_random_points_then_resume_ends_like_an_uninterrupted_run(
    tmp_path, tiny_model_dir, prompt_files
):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    reference = tmp_path / "uninterrupted"
    subprocess.run(
        command(tiny_model_dir, prompt_files[0], reference),
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )

    killed = tmp_path / "killed"
    checkpoints = killed / "checkpoints"
    wanted = KILLS
    rng = random.Random(20261130)
    log = []
    while len(log) < wanted:
        start_step = newest_step(checkpoints)
        process = subprocess.Popen(
            command(tiny_model_dir, prompt_files[0], killed),
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        if rng.random() < 0.2:
            # anywhere in start-up: imports, model loading, resume, partial-folder cleanup
            time.sleep(rng.uniform(0.5, 6.0))
        else:
            # during training: after the run has made progress, a little later (often mid-write)
            deadline = time.monotonic() + 120
            while newest_step(checkpoints) <= start_step and process.poll() is None:
                assert time.monotonic() < deadline, "the resumed run made no progress"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.15))
        if process.poll() is not None:
            stderr = process.stderr.read().decode()
            assert process.returncode == 0, stderr
            pytest.fail(f"the run finished after {len(log)} kills; give it more iterations")
        process.send_signal(signal.SIGKILL)
        process.wait()
        process.stderr.close()
        visible = check_every_checkpoint(checkpoints)
        hidden = sorted(p.name for p in checkpoints.glob(".*")) if checkpoints.is_dir() else []
        log.append(
            {
                "kill": len(log) + 1,
                "step_before": start_step,
                "step_after": newest_step(checkpoints),
                "checkpoints": visible,
                "hidden_leftovers": hidden,
            }
        )

    # What the last kill left: the checkpoints the final run must resume from (all verified above).
    left_by_last_kill = {int(p.name.split("-")[1]) for p in list_checkpoints(checkpoints)}
    assert left_by_last_kill and 0 < max(left_by_last_kill) < ITERATIONS, left_by_last_kill
    finished = subprocess.run(
        command(tiny_model_dir, prompt_files[0], killed),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert finished.returncode == 0, finished.stderr
    summary = json.loads((killed / "candidate" / "training_summary.json").read_text())
    assert summary["iterations"] == ITERATIONS
    assert summary["resumed_from"] == max(left_by_last_kill), (
        f"the final run resumed from {summary['resumed_from']}, not from the newest checkpoint "
        f"left by the last kill ({sorted(left_by_last_kill)})"
    )
    assert f"(resumed at {max(left_by_last_kill)})" in " ".join(finished.stderr.split())
    assert not list(checkpoints.glob(".*")), "leftovers of killed writers were not removed"
    check_every_checkpoint(checkpoints)

    expected, actual = final_parameters(reference), final_parameters(killed)
    assert expected.keys() == actual.keys()
    worst = max((expected[k] - actual[k]).abs().max().item() for k in expected)
    progress = [entry["step_after"] - entry["step_before"] for entry in log]
    print(
        json.dumps(
            {
                "kills": len(log),
                "killed_during_training": sum(p > 0 for p in progress),
                "final_run_resumed_from": summary["resumed_from"],
                "kills_that_left_hidden_leftovers": sum(bool(e["hidden_leftovers"]) for e in log),
                "largest_parameter_difference": worst,
                "log": log,
            },
            indent=1,
        )
    )
    assert worst == 0.0, f"resumed run differs from the uninterrupted one by {worst}"
