"""docs/customizing.md's "Using your own model, data and reward" block, run verbatim on a tiny Llama-style
model: it trains on the new prompts with the user's reward and evaluates with that reward."""

import json

import pandas as pd
import pytest

from tests.flows.conftest import doc_block, make_tiny_project, run_doc_block
from tests.helpers import build_tiny_llama

DOC = "docs/customizing.md"
SECTION = "# Using your own model, data and reward"

REWARD_MODULE = '''
import json


def score(prompts, responses):
    """Likes the word "fine"; logs which prompts it was asked to score."""
    with open("reward_calls.jsonl", "a") as log:
        log.write(json.dumps(prompts) + "\\n")
    return [float(" fine" in r) - 0.5 for r in responses]
'''


@pytest.mark.slow
def test_the_documented_own_model_block_runs_verbatim(tmp_path):
    project = make_tiny_project(tmp_path / "project")
    model = build_tiny_llama(tmp_path / "hf-model")
    mine = [f"The new gadget number {i} turned out to be" for i in range(60)]
    (project / "my_prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in mine)
    )
    (project / "my_module.py").write_text(REWARD_MODULE)
    assert "my_module:score" in doc_block(DOC, SECTION)
    run_doc_block(project, DOC, SECTION, {"/path/to/hf-model": str(model)})

    # the policy is the imported Llama, and the new prompts were prepared and trained on
    policy_config = json.loads((project / "models" / "candidate" / "config.json").read_text())
    assert policy_config["model_type"] == "llama"
    train_prompts = set(pd.read_parquet(project / "data" / "prepared" / "train.parquet")["prompt"])
    assert set(mine) & train_prompts
    calls = [json.loads(line) for line in (project / "reward_calls.jsonl").read_text().splitlines()]
    scored = {prompt for call in calls for prompt in call}
    assert scored & set(mine) & train_prompts, "the user's reward never saw a new train prompt"

    # evaluation scored with the reward the candidate was trained with, not params.yaml's
    report = (project / "reports" / "eval" / "report.md").read_text()
    assert "my_module:score" in report
    assert json.loads((project / "reports" / "promotion.json").read_text())["decision"] in (
        "promoted",
        "rejected",
    )
