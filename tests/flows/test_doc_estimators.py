"""docs/customizing.md's block of advantage estimators, run verbatim on a tiny project: every command
trains, and a critic-free candidate holds no value head."""

import json

import pytest

from tests.flows.conftest import run_doc_block

DOC = "docs/customizing.md"
SECTION = "## Advantage estimators: with or without a critic"


@pytest.mark.slow
def test_the_documented_estimators_block_runs_verbatim(tiny_project):
    project = tiny_project  # prepared, validated data and the tiny base model
    output = run_doc_block(project, DOC, SECTION, {})
    assert output.count("trained 2 iterations") == 4, output
    candidate = project / "models" / "candidate"
    assert not (candidate / "value_head.safetensors").exists()
    config = json.loads((candidate / "training_summary.json").read_text())["final_metrics"]
    assert "ppo/kl_loss" in config and "ppo/value_loss" not in config
