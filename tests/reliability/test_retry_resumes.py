"""A retried training task resumes from the last checkpoint instead of starting over.

The flow's ``train`` task (retries=2) runs ``dvc repro train``; a retry runs the same command
again. Here the first attempt is killed (its whole process group, as a lost worker would be) after
it has written checkpoints, and the second attempt must report that it resumed, with DVC having
kept the checkpoints (``persist: true``) and its own lock released.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from flows.orchestration.run_params import set_params
from tests.flows.conftest import BIN, dvc, environment

pytestmark = pytest.mark.slow


ITERATIONS = 30  # the first attempt is killed after its second checkpoint, at most a few later


def test_a_retried_train_stage_resumes_from_its_checkpoint(tiny_project):
    project = tiny_project  # prepared, validated data and a base model: `dvc repro train` trains
    set_params(str(project), {"train.iterations": ITERATIONS, "train.checkpoint_every": 1})
    first = subprocess.Popen(
        [str(BIN / "dvc"), "repro", "train"],
        cwd=project,
        env=environment(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkpoints = project / "checkpoints"
    deadline = time.monotonic() + 300
    while len(list(checkpoints.glob("step-*"))) < 2:
        assert first.poll() is None, "the first attempt ended before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    done = int(sorted(checkpoints.glob("step-*"))[-1].name.split("-")[1])

    retry = dvc(project, "repro", "train")
    assert retry.returncode == 0, retry.stderr[-3000:]
    output = retry.stdout + retry.stderr
    assert "resumed at" in output, output[-3000:]
    resumed_at = int(output.split("resumed at")[1].split(")")[0].strip())
    # from the newest checkpoint the killed attempt left, not from scratch (which would end with
    # the same parameters) nor from an older one
    assert resumed_at == done > 0
    summary = json.loads((project / "models" / "candidate" / "training_summary.json").read_text())
    assert summary["resumed_from"] == done and summary["iterations"] == ITERATIONS
