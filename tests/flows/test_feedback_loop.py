"""The feedback loop on the tiny default, stage by stage: feedback prepared and validated,
a reward model trained, gated against the current version and versioned, PPO trained against
``reward:current`` and judged with that version and the one before it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from flows import stages
from flows.cli import app
from flows.reward_stage import reward
from ppo_core.base_sources.review_grammar import example_feedback
from ppo_core.config import load_config
from ppo_core.registry.rewards import current_reward, load_reward_registry
from tests.flows.conftest import ROOT

QUICK = [
    "threads=1",
    "validation.min_train_rows=16",
    "validation.min_eval_rows=4",
    "validation.min_train_pairs=16",
    "validation.min_eval_pairs=4",
    "reward_model.epochs=2",
    "ppo.rollout_batch_size=16",
    "ppo.mini_batch_size=8",
    "ppo.micro_batch_size=8",
    "ppo.epochs=1",
    "generation.max_new_tokens=6",
    "train.iterations=1",
    "eval.num_prompts=8",
    "eval.samples_per_prompt=1",
]


def write_feedback(folder: Path, name: str, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def project(tmp_path, tiny_model_dir, monkeypatch) -> Path:
    """A folder laid out like the project (relative default paths), 120 raw prompts and the
    tiny model as the policy; the working folder for the test."""
    (tmp_path / "data" / "raw").mkdir(parents=True)
    raw = (ROOT / "data" / "raw" / "prompts.jsonl").read_text().splitlines()[:120]
    (tmp_path / "data" / "raw" / "prompts.jsonl").write_text("\n".join(raw) + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def config_of(tiny_model_dir, *extra: str):
    return load_config(overrides=[f"model.policy={tiny_model_dir}", *QUICK, *extra])


def prepare_and_validate(config) -> None:
    stages.prepare(config)
    stages.validate(config)


def test_without_feedback_the_reward_stage_trains_nothing(project, tiny_model_dir):
    config = config_of(tiny_model_dir)
    prepare_and_validate(config)
    manifest = json.loads((project / "data/prepared/feedback/manifest.json").read_text())
    assert manifest["pairs"] == 0
    decision = reward(config, progress=lambda _: None)
    assert decision["decision"] == "no feedback"
    assert json.loads((project / "reports/reward/current.json").read_text())["current"] is None
    assert not (project / "models/rewards").exists()


def test_two_feedback_versions_gate_and_version_the_reward_and_ppo_uses_the_winner(
    project, tiny_model_dir
):
    config = config_of(tiny_model_dir)
    write_feedback(project / "data/feedback", "first.jsonl", example_feedback(120, seed=0))
    prepare_and_validate(config)
    first = reward(config, progress=lambda _: None)
    assert first["decision"] == "promoted" and first["version"] == "r0001"
    assert first["parent"] is None and first["metrics"]["accuracy"] >= 0.6
    assert first["score_std"] > 0 and len(first["content_sha256"]) == 64
    # the second ingest: ratings made into pairs, judged against r0001 on the same pairs
    write_feedback(
        project / "data/feedback", "second.jsonl", example_feedback(120, seed=1, ratings=True)
    )
    prepare_and_validate(config)
    counts = json.loads((project / "data/prepared/feedback/manifest.json").read_text())["counts"]
    assert counts["rating_rows"] == 120 and counts["ratings_pairs"] > 0
    second = reward(config, progress=lambda _: None)
    assert second["parent"] == "r0001"
    assert any("vs the current version's" in reason for reason in second["reasons"])
    assert second["decision"] == "promoted" and second["version"] == "r0002", second["reasons"]
    winner = current_reward("models/rewards")
    assert winner is not None and winner.name == "r0002"
    # PPO against reward:current trains on r0002 and records it
    ppo = config_of(tiny_model_dir, "model.reward=reward:current")
    stages.train(ppo, show_progress=False)
    summary = json.loads((project / "models/candidate/training_summary.json").read_text())
    assert summary["reward"] == "reward:r0002"
    stages.evaluate(ppo)
    models = json.loads((project / "reports/eval/models.json").read_text())
    metrics = json.loads((project / "reports/eval/metrics.json").read_text())
    assert models["reward"] == "reward:r0002" and models["previous_reward"] == "reward:r0001"
    assert "candidate/previous_reward_score" in metrics
    assert "baseline/previous_reward_score" in metrics
    entry = stages.promote(ppo)
    assert entry["reward"] == "reward:r0002" and entry["previous_reward"] == "reward:r0001"
    assert any("previous reward version" in reason for reason in entry["reasons"])


def test_a_worse_reward_model_is_rejected_and_training_stays_on_the_incumbent(
    project, tiny_model_dir
):
    config = config_of(tiny_model_dir)
    write_feedback(project / "data/feedback", "first.jsonl", example_feedback(120, seed=0))
    prepare_and_validate(config)
    assert reward(config, progress=lambda _: None)["version"] == "r0001"
    before = (project / "reports/reward/current.json").read_bytes()
    # a model that cannot learn in its budget: its accuracy falls below r0001's
    worse = config_of(tiny_model_dir, "reward_model.lr=1e-9", "reward_model.epochs=1")
    decision = reward(worse, progress=lambda _: None)
    assert decision["decision"] == "rejected", decision["reasons"]
    assert any(r.startswith("fail:") for r in decision["reasons"])
    assert (project / "reports/reward/current.json").read_bytes() == before
    assert load_reward_registry("models/rewards")["current"] == "r0001"
    kept = sorted(p.name for p in (project / "models/rewards").iterdir())
    assert kept == [".registry.json.lock", "r0001", "registry.json"]  # no staging folder left


class Killed(Exception):
    """Stands for a kill after the first epoch's checkpoint."""


def test_a_killed_reward_run_resumes_to_the_uninterrupted_model(project, tiny_model_dir):
    from ppo_core.preference.pairs import read_pair_split
    from ppo_core.preference.training import train_reward_model

    write_feedback(project / "data/feedback", "first.jsonl", example_feedback(80, seed=0))
    config = config_of(tiny_model_dir)
    prepare_and_validate(config)
    pairs = read_pair_split("data/prepared/feedback", "train", chat=False)

    def kill_after_first_epoch(line: str) -> None:
        if line.startswith("reward model epoch 1/"):
            raise Killed

    with pytest.raises(Killed):
        train_reward_model(config, pairs, "hash", progress=kill_after_first_epoch)
    notes: list[str] = []
    resumed = train_reward_model(config, pairs, "hash", progress=notes.append)
    assert resumed.resumed_from == "step-000001", notes
    interrupted = load_file(str(Path(resumed.output_dir) / "model.safetensors"))
    shutil.rmtree("models/reward_checkpoints")
    whole = train_reward_model(
        config_of(tiny_model_dir, "reward_model.output_dir=models/uninterrupted"), pairs, "hash"
    )
    assert whole.resumed_from is None
    uninterrupted = load_file(str(Path(whole.output_dir) / "model.safetensors"))
    assert interrupted.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert (interrupted[name] - tensor).abs().max() == 0, name


@pytest.mark.parametrize(
    "precision, dtype", [("bf16", "torch.bfloat16"), ("fp32", "torch.float32")]
)
def test_the_reward_model_trains_in_its_precision_and_reports_each_step(
    project, tiny_model_dir, monkeypatch, precision, dtype
):
    import warnings

    import ppo_core.preference.training as training
    from ppo_core.parallel.runtime import PrecisionWarning
    from ppo_core.preference.pairs import read_pair_split

    write_feedback(project / "data/feedback", "first.jsonl", example_feedback(80, seed=0))
    config = config_of(tiny_model_dir, f"precision={precision}", "reward_model.epochs=2")
    prepare_and_validate(config)
    pairs = read_pair_split("data/prepared/feedback", "train", chat=False)
    seen: set[str] = set()
    build = training.new_reward_classifier

    def hooked(*args, **kwargs):
        model = build(*args, **kwargs)
        first_linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        first_linear.register_forward_hook(lambda _m, _i, out: seen.add(str(out.dtype)))
        return model

    monkeypatch.setattr(training, "new_reward_classifier", hooked)
    steps: list[tuple[int, int]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)  # an AVX2 CPU: bf16 runs, slowly
        result = training.train_reward_model(
            config, pairs, "hash", on_step=lambda *s: steps.append(s)
        )
    assert seen == {dtype}
    per_epoch = -(-len(pairs) // config.reward_model.batch_size)
    assert steps == [(k, 2 * per_epoch) for k in range(1, 2 * per_epoch + 1)]
    assert result.record["settings"]["precision"] == precision


BAD_FEEDBACK = {
    "empty reply": (
        [{"prompt": "The movie was", "chosen": " ", "rejected": " dull."}],
        "chosen_chars",
    ),
    "identical pair": (
        [{"prompt": "The movie was", "chosen": " great.", "rejected": " great."}],
        "same_reply",
    ),
    "too few pairs": ([], "expect_table_row_count_to_be_between"),
    "malformed row": ([{"prompt": "The movie was", "choosen": " great."}], "choosen"),
}


@pytest.mark.parametrize("problem", sorted(BAD_FEEDBACK))
def test_bad_feedback_is_one_line_and_publishes_nothing(project, tiny_model_dir, problem):
    """Each bad file: prepare or validate fails with the problem named, the published data
    (prompts and the earlier feedback) and the current reward version stay."""
    runner = CliRunner()
    overrides = [f"model.policy={tiny_model_dir}", *QUICK]
    rows, named = BAD_FEEDBACK[problem]
    good = example_feedback(60 if problem != "too few pairs" else 3, seed=5)
    write_feedback(project / "data/feedback", "first.jsonl", example_feedback(120, seed=0))
    for command in ("prepare", "validate"):
        done = runner.invoke(app, [command, "--config", "none", *overrides])
        assert done.exit_code == 0, done.output
    before = {p: p.read_bytes() for p in (project / "data/prepared").rglob("*") if p.is_file()}
    (project / "data/feedback/first.jsonl").unlink()
    write_feedback(project / "data/feedback", "bad.jsonl", good + rows)
    outputs = ""
    for command in ("prepare", "validate"):
        done = runner.invoke(app, [command, "--config", "none", *overrides])
        outputs += done.output
        if done.exit_code != 0:
            break
    assert done.exit_code != 0, outputs
    assert named in outputs, outputs
    assert "Traceback" not in outputs
    after = {p: p.read_bytes() for p in (project / "data/prepared").rglob("*") if p.is_file()}
    assert after == before


def test_a_judged_pair_version_is_not_trained_again_and_a_rollback_moves_current(
    project, tiny_model_dir
):
    from flows.reward_stage import write_current
    from ppo_core.registry.rewards import roll_back_reward

    config = config_of(tiny_model_dir)
    write_feedback(project / "data/feedback", "first.jsonl", example_feedback(120, seed=0))
    prepare_and_validate(config)
    assert reward(config, progress=lambda _: None)["version"] == "r0001"
    again = reward(config, progress=lambda _: None)
    assert again["decision"] == "already judged" and again["current"] == "r0001"
    # other settings are another judgement
    margin = config_of(
        tiny_model_dir, "reward_model.margin=0.5", "reward_model.gate.max_accuracy_drop=1.0"
    )
    other = reward(margin, progress=lambda _: None)
    assert other["decision"] == "promoted" and other["version"] == "r0002"
    roll_back_reward("models/rewards", "r0001", "the margin run overfits", "test")
    write_current(Path("reports/reward"), "models/rewards")
    current = json.loads((project / "reports/reward/current.json").read_text())
    assert current["current"] == "r0001"
    # the stage run again (dvc repro after the rollback) keeps the rolled-back version
    assert reward(config, progress=lambda _: None)["current"] == "r0001"
