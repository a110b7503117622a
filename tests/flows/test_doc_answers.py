"""docs/customizing.md's "Rewards that check an answer" block, run verbatim on a tiny project:
rows carry an ``answer`` through prepare's split (never across it), validate checks and
publishes the field, train and evaluate take it from the validated version and give it to the
reward as a keyword, and evaluation reports accuracy and pass@k for the gate."""

import json

import pandas as pd
import pytest

from tests.flows.conftest import read_json, run_doc_block

DOC = "docs/customizing.md"
SECTION = "## Rewards that check an answer"


def answer_of(prompt: str) -> str:
    """Each row's answer, a function of its prompt, so that a row's answer can be checked
    wherever it ends up."""
    return "good" if len(prompt) % 2 else "bad"


@pytest.mark.slow
def test_the_documented_answers_block_runs_verbatim(tiny_project):
    from ppo_core.base_sources.review_grammar import default_prompts

    project = tiny_project
    prompts = default_prompts(120, seed=3)
    rows = [{"prompt": p, "answer": answer_of(p)} for p in prompts]
    (project / "my_problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = run_doc_block(project, DOC, SECTION, {})
    assert "candidate " in output  # promote printed its decision

    # the split: every row's answer beside its own prompt, none on the other side
    prepared = project / "data" / "prepared"
    sides = {}
    for split in ("train", "eval"):
        frame = pd.read_parquet(prepared / f"{split}.parquet")
        assert list(frame.columns) == ["prompt", "references"]
        for prompt, references in zip(frame["prompt"], frame["references"], strict=True):
            assert json.loads(references) == {"answer": answer_of(prompt)}, prompt
        sides[split] = set(frame["prompt"])
    assert sides["train"] and sides["eval"] and not sides["train"] & sides["eval"]
    record = read_json(prepared / "validated_with.json")
    assert record["reference_fields"] == ["answer"]
    summary = read_json(project / "reports" / "validation" / "summary.json")
    assert summary["success"] and summary["settings"]["reference_fields"] == ["answer"]
    assert any(
        check["column"] == "reference_fields_present"
        for check in summary["splits"]["train"]["expectations"]
    )

    # evaluation scored each reply against its own prompt's answer
    samples = read_json(project / "reports" / "eval" / "samples.json")["candidate"]
    for sample in samples:
        expected = float(answer_of(sample["prompt"]) in sample["response"].lower())
        assert sample["score"] == expected, sample
    metrics = read_json(project / "reports" / "eval" / "metrics.json")
    for side in ("candidate", "baseline"):
        assert 0.0 <= metrics[f"{side}/accuracy"] <= metrics[f"{side}/pass_at_4"] <= 1.0
        assert metrics[f"{side}/pass_at_1"] == pytest.approx(metrics[f"{side}/accuracy"])
    assert "delta/accuracy" in metrics
    decision = read_json(project / "reports" / "promotion.json")
    assert any("standard errors" in reason for reason in decision["reasons"]), decision
