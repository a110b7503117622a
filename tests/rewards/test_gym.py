"""reasoning-gym tasks: rows generated offline with their answers, scored by each task's own
scorer, and only tasks whose scorers run no model output."""

from __future__ import annotations

import inspect
import json
import re
import sys

import pytest
from typer.testing import CliRunner

from ppo_core.rewards.gym import (
    DEFAULT_GYM_TASKS,
    GYM_FIELDS,
    GYM_TASKS,
    GymTaskError,
    gym_answer,
    gym_rows,
    gym_verdict,
)
from ppo_core.rewards.loading import build_reward_fn

RUNS_CODE = re.compile(r"\beval\(|\bexec\(|parse_expr|sympify|literal_eval|__import__|compile\(")


def _scorer_source(task: str) -> str:
    """The source of the task's ``score_answer`` and of the reasoning-gym functions it calls
    (``utils.compute_decimal_reward``, ...), one level down."""
    from reasoning_gym.factory import DATASETS

    method = DATASETS[task][0].score_answer
    source = inspect.getsource(method)
    module = sys.modules[method.__module__]
    for name in set(re.findall(r"\b([A-Za-z_][\w.]*)\(", source)):
        target: object = module
        for part in name.split("."):
            target = getattr(target, part, None)
        if inspect.isfunction(target) and target.__module__.startswith("reasoning_gym"):
            source += inspect.getsource(target)
    return source


@pytest.mark.parametrize("task", list(GYM_TASKS))
def test_a_used_tasks_scorer_runs_no_model_output(task):
    """Seen failing: with ``n_queens`` (its scorer ``eval``s the reply) in the list."""
    found = RUNS_CODE.findall(_scorer_source(task))
    assert not found, f"{task}'s scorer calls {found}"


def test_rows_are_seeded_offline_and_each_answer_scores_one():
    rows = gym_rows(["chain_sum", "word_sorting"], size=3, seed=7)
    assert rows == gym_rows(["chain_sum", "word_sorting"], size=3, seed=7)
    assert rows != gym_rows(["chain_sum", "word_sorting"], size=3, seed=8)
    assert [row["task"] for row in rows] == ["chain_sum"] * 3 + ["word_sorting"] * 3
    assert all(set(GYM_FIELDS) <= set(row) and "<answer>" in row["prompt"] for row in rows)
    for row in json.loads(json.dumps(rows)):  # as prepare reads them back
        right = f"I think <answer>{row['answer']}</answer>"
        assert gym_verdict(right, row["answer"], row["task"], row["metadata"]).score == 1.0
        assert gym_verdict("no tag", row["answer"], row["task"], row["metadata"]).reason == (
            "unparsed"
        )
    chat = gym_rows(["gcd"], size=1, seed=0, chat=True)[0]
    assert chat["messages"][0]["role"] == "user" and "prompt" not in chat


def test_the_reward_counts_its_reasons_and_a_task_outside_the_list_is_an_error():
    rows = gym_rows(["chain_sum"], size=3, seed=0)
    reward = build_reward_fn("builtin:reasoning_gym", reference_fields=GYM_FIELDS)
    references = {field: [row[field] for row in rows] for field in GYM_FIELDS}
    references["task"][2] = "n_queens"  # a row naming a task whose scorer evals: never run
    replies = [f"<answer>{rows[0]['answer']}</answer>", "<answer>x</answer>", "<answer>1</answer>"]
    scores = reward([row["prompt"] for row in rows], replies, references)
    assert scores.tolist() == [1.0, 0.0, 0.0]
    assert reward.source.last_reasons == {"correct": 1, "wrong": 1, "error": 1}
    assert gym_answer("<answer> 1 </answer> then <answer>2</answer>") == "2"
    with pytest.raises(GymTaskError, match="'countdown' is not one used here"):
        gym_rows(["countdown"], size=1, seed=0)


def test_ppo_tasks_writes_a_prompt_file_and_never_replaces_one(tmp_path):
    from flows.cli import app

    target = tmp_path / "raw" / "tasks.jsonl"
    result = CliRunner().invoke(app, ["tasks", str(target), "--size", "2"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert sorted({row["task"] for row in rows}) == sorted(DEFAULT_GYM_TASKS)
    assert "data.reference_fields=[answer,task,metadata]" in result.output
    again = CliRunner().invoke(app, ["tasks", str(target), "--task", "gcd"])
    assert again.exit_code == 2 and "never replaced" in again.output
    assert [json.loads(line) for line in target.read_text().splitlines()] == rows
    refused = CliRunner().invoke(app, ["tasks", str(tmp_path / "x.jsonl"), "--task", "puzzle24"])
    assert refused.exit_code == 2 and "not one used here" in refused.output
