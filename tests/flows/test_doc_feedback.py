"""docs/customizing.md's feedback-loop block, run verbatim on a tiny project: two feedback
versions, two reward versions (the second judged against the first), PPO trained on each."""

import json

import pytest

from tests.flows.conftest import ROOT, run_doc_block

DOC = "docs/customizing.md"
SECTION = "## Learning the reward from feedback"


@pytest.mark.slow
def test_the_documented_feedback_block_runs_verbatim(tiny_project):
    project = tiny_project  # prepared, validated data and the tiny base model
    # the project copy holds no docs/: the block's example files come from the repository
    examples = project / "docs" / "examples" / "feedback"
    examples.mkdir(parents=True)
    for name in ("first.jsonl", "second.jsonl"):
        (examples / name).write_bytes((ROOT / "docs/examples/feedback" / name).read_bytes())
    output = run_doc_block(project, DOC, SECTION, {})
    assert "reward model promoted as r0001" in output, output
    registry = json.loads((project / "models/rewards/registry.json").read_text())
    second = registry["entries"][-1]
    assert second["parent"] == "r0001"
    assert any("vs the current version's" in r for r in second["reasons"])
    summary = json.loads((project / "models/candidate/training_summary.json").read_text())
    assert summary["reward"] == f"reward:{registry['current']}"
    models = json.loads((project / "reports/eval/models.json").read_text())
    if registry["current"] == "r0002":
        assert models["previous_reward"] == "reward:r0001"
