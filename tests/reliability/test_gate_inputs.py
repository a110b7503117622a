"""The gate's inputs, planted as a user (or an attacker) could leave them: `ppo promote` decides
only on an evaluation of this candidate with every metric its rules read present and finite,
and never promotes on what such files lack."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from flows import stages
from ppo_core.config import load_config
from ppo_core.registry.promotion import StaleEvaluationError
from ppo_core.registry.versions import load_registry

SIDE = {
    "score": 0.6,
    "kl_to_reference": 1.0,
    "kl_to_origin": 1.0,
    "eos_rate": 1.0,
    "distinct_2": 0.8,
    "reference_nll": 2.0,
    "check_score": 0.5,
}


def planted(tmp_path: Path, metrics: dict, models: dict | None = None):
    """A config whose evaluation folder holds ``metrics`` (flat, as evaluate writes it) and
    ``models`` (default: an evaluation of the candidate, checked by AFINN)."""
    candidate = tmp_path / "candidate"
    candidate.mkdir(exist_ok=True)
    (candidate / "config.json").write_text("{}")
    (candidate / "model.safetensors").write_text("weights")
    evaluation = tmp_path / "eval"
    evaluation.mkdir(exist_ok=True)
    (evaluation / "metrics.json").write_text(json.dumps(metrics))
    (evaluation / "models.json").write_text(
        json.dumps(models or {"candidate": str(candidate), "check_reward": "builtin:afinn"})
    )
    return load_config(
        overrides=[
            f"train.output_dir={candidate}",
            f"eval.output_dir={evaluation}",
            f"promote.registry={tmp_path / 'registry.json'}",
            f"promote.production_dir={tmp_path / 'production'}",
            f"promote.report={tmp_path / 'promotion.json'}",
            f"model.policy={tmp_path / 'base'}",
            "promote.check_reward=builtin:afinn",
        ]
    )


def flat(**sides: dict) -> dict:
    return {f"{name}/{key}": value for name, side in sides.items() for key, value in side.items()}


def test_a_fair_evaluation_promotes(tmp_path):
    (tmp_path / "base").mkdir()  # the chain's origin, stored on the first promotion
    (tmp_path / "base" / "config.json").write_text("{}")
    (tmp_path / "base" / "model.safetensors").write_text("base weights")
    config = planted(tmp_path, flat(candidate=SIDE, baseline={**SIDE, "score": 0.3}))
    assert stages.promote(config)["decision"] == "promoted"


@pytest.mark.parametrize(
    ("case", "baseline", "failed"),
    [
        ("no baseline group", None, ["score", "distinct_2", "reference_nll", "check_score"]),
        ("no distinct_2", {k: v for k, v in SIDE.items() if k != "distinct_2"}, ["distinct_2"]),
        ("no check_score", {k: v for k, v in SIDE.items() if k != "check_score"}, ["check_score"]),
        (
            "+Infinity",
            {**SIDE, "score": float("-inf"), "distinct_2": float("inf")},
            ["score", "distinct_2"],
        ),
        ("NaN", {**SIDE, "reference_nll": float("nan")}, ["reference_nll"]),
    ],
)
def test_what_metrics_json_lacks_is_a_rejection_naming_it(tmp_path, case, baseline, failed):
    sides = {"candidate": SIDE} if baseline is None else {"candidate": SIDE, "baseline": baseline}
    config = planted(tmp_path, flat(**sides))  # JSON writes inf and NaN as Infinity and NaN
    entry = stages.promote(config)
    assert entry["decision"] == "rejected", case
    refusals = [r for r in entry["reasons"] if r.startswith("FAIL: cannot judge")]
    assert [next(k for k in SIDE if f" {k} " in r) for r in refusals] == failed, refusals
    assert load_registry(config.promote.registry)["current"] is None


@pytest.mark.parametrize(
    ("models", "named"),
    [
        ({"candidate": "/somewhere/else", "check_reward": "builtin:afinn"}, "/somewhere/else"),
        ({"check_reward": "builtin:afinn"}, "None"),
        ({"candidate": "CANDIDATE", "check_reward": "mymod:lenient"}, "mymod:lenient"),
        ({"candidate": "CANDIDATE"}, "check_reward 'None'"),
    ],
)
def test_an_evaluation_of_another_candidate_or_scorer_decides_nothing(tmp_path, models, named):
    candidate = str(tmp_path / "candidate")
    models = {k: candidate if v == "CANDIDATE" else v for k, v in models.items()}
    config = planted(tmp_path, flat(candidate=SIDE, baseline=SIDE), models)
    with pytest.raises(StaleEvaluationError, match="run `ppo evaluate` again") as refused:
        stages.promote(config)
    assert named in str(refused.value)
    assert not Path(config.promote.registry).exists()
    assert not Path(config.promote.report).exists()


def test_a_models_file_that_is_not_json_decides_nothing(tmp_path):
    config = planted(tmp_path, flat(candidate=SIDE, baseline=SIDE))
    (tmp_path / "eval" / "models.json").write_text("{not json")
    with pytest.raises(StaleEvaluationError, match="models.json is not valid JSON"):
        stages.promote(config)
    assert not Path(config.promote.registry).exists()


def test_a_candidate_of_a_withdrawn_reward_version_is_not_promoted(tmp_path):
    """Trained and judged against reward:r0002, then the reward rolled back to r0001: with
    model.reward=reward:current, promote refuses, naming both versions, and writes nothing.
    Seen failing before the check (the candidate was promoted with reward:r0002 recorded)."""
    from ppo_core.registry.rewards import record_reward_decision, roll_back_reward

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    (tmp_path / "base" / "model.safetensors").write_text("base weights")
    versions = tmp_path / "rewards"
    for weights in ("w1", "w2"):
        folder = tmp_path / "reward-candidates" / weights
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_text(weights)
        stats = {"reasons": [], "data_hash": weights, "score_mean": 0.0, "score_std": 1.0}
        record_reward_decision(versions, folder, True, stats)
    models = {
        "candidate": str(tmp_path / "candidate"),
        "check_reward": "builtin:afinn",
        "reward": "reward:r0002",
    }
    config = planted(tmp_path, flat(candidate=SIDE, baseline={**SIDE, "score": 0.3}), models)
    (tmp_path / "candidate" / "training_summary.json").write_text(
        json.dumps({"reward": "reward:r0002"})
    )
    config = replace(
        config,
        model=replace(config.model, reward="reward:current"),
        reward_model=replace(config.reward_model, versions_dir=str(versions)),
    )
    roll_back_reward(versions, "r0001", "r0002 prefers long replies", "ops")
    with pytest.raises(
        StaleEvaluationError,
        match="trained against the reward version reward:r0002, but the current reward version is reward:r0001",
    ):
        stages.promote(config)
    assert not Path(config.promote.registry).exists()
    assert not Path(config.promote.report).exists()
