"""The README's block of advantage estimators, run verbatim on a tiny project: every command
trains, and a critic-free candidate holds no value head."""

import json
import subprocess

import pytest

from tests.flows.conftest import BIN, environment, make_tiny_project, run_readme_block

SECTION = "### Advantage estimators: with or without a critic"


@pytest.mark.slow
def test_the_readme_estimators_block_runs_verbatim(tmp_path):
    project = make_tiny_project(tmp_path / "project")
    for stage in ("prepare", "base", "validate"):
        done = subprocess.run(
            [str(BIN / "ppo"), stage],
            cwd=project,
            env=environment(),
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    output = run_readme_block(project, SECTION, {})
    assert output.count("trained 2 iterations") == 4, output
    candidate = project / "models" / "candidate"
    assert not (candidate / "value_head.safetensors").exists()
    config = json.loads((candidate / "training_summary.json").read_text())["final_metrics"]
    assert "ppo/kl_loss" in config and "ppo/value_loss" not in config
