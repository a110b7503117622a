"""docs/customizing.md's reasoning-gym block ("Rewards that check an answer", the block after
"a model of your own"), run verbatim on a tiny project whose base is a tiny model with room for
the questions: ``ppo tasks`` writes problems with their answers, the stages carry the three
reference fields, and training and evaluation score replies with each task's own scorer."""

import json

import pandas as pd
import pytest

from tests.flows.conftest import read_json, run_doc_block

DOC = "docs/customizing.md"
SECTION = "so the block starts from a model of your own"


@pytest.mark.slow
def test_the_documented_reasoning_gym_block_runs_verbatim(tiny_project, tmp_path):
    from ppo_core.base_sources.tiny_default import build_tiny_default

    model = build_tiny_default(
        tmp_path / "long-model", n_sentences=300, steps=1, n_layer=1, n_embd=32, n_positions=640
    )
    output = run_doc_block(tiny_project, DOC, SECTION, {"/path/to/hf-model": str(model)})
    assert "wrote 900 problems" in output

    prepared = tiny_project / "data" / "prepared"
    tasks = set()
    for split in ("train", "eval"):
        frame = pd.read_parquet(prepared / f"{split}.parquet")
        for references in frame["references"]:
            fields = json.loads(references)
            assert set(fields) == {"answer", "task", "metadata"}
            tasks.add(fields["task"])
    assert tasks == {"chain_sum", "letter_counting", "spell_backward"}
    assert read_json(prepared / "validated_with.json")["max_tokens"] == 512

    history = read_json(tiny_project / "models" / "candidate" / "training_summary.json")
    assert history["reward"] == "builtin:reasoning_gym", history
    metrics = read_json(tiny_project / "reports" / "eval" / "metrics.json")
    # a one-step tiny model writes no answer tags: every reply unparsed, scored by the task
    assert metrics["candidate/accuracy"] == 0.0
    assert metrics["candidate/verdict/unparsed"] == 1.0
