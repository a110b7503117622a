"""The PPO loop on a real (tiny) GPT-2: exact micro-batching end to end, resume, determinism,
and bad input that fails before anything is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ppo_core.config import load_config
from ppo_core.models.folders import ModelFolderError
from ppo_core.prompts import PromptFileError
from ppo_core.rewards.loading import RewardError, build_reward_fn
from ppo_core.training.loop import train
from tests.helpers import (
    RECORDED,
    Recorder,
    build_tiny_llama,
    max_relative_difference,
    parameters,
    parameters_after_one_sgd_iteration,
    small_config,
)


def test_micro_batch_size_does_not_change_the_update(
    tmp_path, tiny_model_dir, prompt_files, monkeypatch
):
    """One iteration with SGD: micro-batches of 1 row, of 8 (= mini_batch_size) and of a token
    budget (``ppo.micro_batch_tokens``: as many rows as fit, 2 or 3 here) reach the same
    parameters.

    Seed 1: the rollout of seed 0 holds a token whose ratio ends within float rounding of the
    clip range after eight steps of 0.5, so one summation order clips it and the other does not
    (measured 6.4e-4 there, 2.4e-5 with clipping off); seeds 1, 2, 3 measure 7.2e-7, 4.7e-7,
    2.7e-6."""
    from ppo_core.training import update

    cut = update.cut_micro_batches
    rows_per_pass: list[int] = []

    def recording(*args, **kwargs):
        micro_batches = cut(*args, **kwargs)
        rows_per_pass.extend(len(micro) for micro in micro_batches)
        return micro_batches

    monkeypatch.setattr(update, "cut_micro_batches", recording)
    budget = "ppo.micro_batch_tokens=40"
    results = parameters_after_one_sgd_iteration(
        tmp_path, tiny_model_dir, prompt_files, "seed=1", cuts=(8, budget)
    )
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    # the update moved the weights (so the comparison is not vacuous) ...
    moved = {k: v for k, v in results[8].items() if k in base}
    assert max_relative_difference(moved, base) > 1e-4
    # ... and the same way for every cut. Float32 round-off (another summation order): measured
    # 7.2e-7 for 8 rows (8.6e-6 and 5.3e-6 with the responses of earlier builds) and 3.6e-6 for
    # the budget; the bound is about 12x the largest. The mean-of-means bug measured 1.5.
    assert max_relative_difference(results[1], results[8]) <= 1e-4
    assert max_relative_difference(results[1], results[budget]) <= 1e-4
    # 2 epochs x 2 mini-batches: 32 passes of 1 row, 4 of 8, and by the budget 1 < rows < 8
    by_budget = rows_per_pass[36:]
    assert rows_per_pass[:36] == [1] * 32 + [8] * 4 and sum(by_budget) == 32
    assert min(by_budget) > 1 and max(by_budget) < 8, by_budget


def test_same_seed_same_metrics(tmp_path, tiny_model_dir, prompt_files):
    runs = []
    for name in ("a", "b"):
        recorder = Recorder()
        train(small_config(tmp_path / name, tiny_model_dir, prompt_files), loggers=[recorder])
        runs.append(recorder.rows)
    strip = [
        [(i, {k: v for k, v in m.items() if not k.startswith("perf/")}) for i, m in run]
        for run in runs
    ]
    assert strip[0] == strip[1]
    assert len(strip[0]) == 2


def test_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_dir, prompt_files):
    full = small_config(tmp_path / "full", tiny_model_dir, prompt_files, "train.iterations=3")
    train(full)
    part = tmp_path / "part"
    train(small_config(part, tiny_model_dir, prompt_files, "train.iterations=1"))
    # the run is "interrupted" after iteration 1; a rerun with the full length resumes from it
    recorder = Recorder()
    summary = train(
        small_config(part, tiny_model_dir, prompt_files, "train.iterations=3"), loggers=[recorder]
    )
    assert summary.resumed_from == 1
    assert [i for i, _ in recorder.rows] == [1, 2, 3]  # history replayed, then iterations 2 and 3
    assert (
        max_relative_difference(
            parameters(part / "candidate"), parameters(tmp_path / "full" / "candidate")
        )
        == 0.0
    )
    state = json.loads((part / "checkpoints" / "step-000003" / "trainer_state.json").read_text())
    assert state["iteration"] == 3 and "config" in state


class Stop(Exception):
    """Raised by :class:`StopAt` in place of a kill."""


class StopAt(Recorder):
    """A logger that stops the run when iteration ``iteration`` is logged: after its update and
    before its checkpoint, as a kill at that moment would (the previous checkpoint is the
    newest)."""

    def __init__(self, iteration: int):
        super().__init__()
        self.iteration = iteration

    def log(self, iteration, metrics):
        super().log(iteration, metrics)
        if iteration == self.iteration:
            raise Stop(f"stopped at iteration {iteration}")


def test_an_adaptive_kl_coefficient_survives_a_stop_and_resume(
    tmp_path, tiny_model_dir, prompt_files
):
    """The adaptive controller's coefficient is state a checkpoint must carry: a run stopped
    during iteration 2 and resumed from checkpoint 1 uses, logs and saves the coefficients of a
    run that never stopped, and reaches its weights exactly."""
    adaptive = ("kl.adaptive=true", "kl.target=1.0", "kl.horizon=100")
    whole = Recorder()
    train(
        small_config(tmp_path / "whole", tiny_model_dir, prompt_files, *adaptive), loggers=[whole]
    )
    stopped = tmp_path / "stopped"
    with pytest.raises(Stop):
        train(small_config(stopped, tiny_model_dir, prompt_files, *adaptive), loggers=[StopAt(2)])
    assert [p.name for p in (stopped / "checkpoints").glob("step-*")] == ["step-000001"]
    resumed = Recorder()
    summary = train(
        small_config(stopped, tiny_model_dir, prompt_files, *adaptive), loggers=[resumed]
    )
    assert summary.resumed_from == 1

    def coefficients(recorder: Recorder) -> list[float]:
        return [metrics["rollout/kl_coef"] for _, metrics in recorder.rows]

    # 0.1, then 0.1 * (1 - 0.2 * 16 / 100) after the first iteration's KL of 0: it did adapt
    assert coefficients(whole)[0] == 0.1 and coefficients(whole)[1] == pytest.approx(0.0968)
    assert coefficients(resumed) == coefficients(whole)  # exactly, the resumed iteration too

    def saved(folder: Path) -> float:
        state = folder / "checkpoints" / "step-000002" / "trainer_state.json"
        return json.loads(state.read_text())["kl_coef"]

    assert saved(stopped) == saved(tmp_path / "whole") != coefficients(whole)[1]
    assert (
        max_relative_difference(
            parameters(stopped / "candidate"), parameters(tmp_path / "whole" / "candidate")
        )
        == 0.0
    )


def test_a_tampered_metric_name_in_a_checkpoint_writes_no_file_outside(
    tmp_path, tiny_model_dir, prompt_files
):
    """Checksums guard against damage, not against someone who rewrites them too: the history's
    metric names become file paths in the metrics logger, so they are checked on resume."""
    from flows.loggers import DVCLiveLogger
    from ppo_core.checkpoints.store import CheckpointError
    from ppo_core.files import file_sha256

    run = tmp_path / "run"
    train(small_config(run, tiny_model_dir, prompt_files, "train.iterations=1"))
    step = run / "checkpoints" / "step-000001"
    state_file = step / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["history"][0]["../../escaped"] = 1.0
    state_file.write_text(json.dumps(state))
    sums = json.loads((step / "checksums.json").read_text())
    sums["trainer_state.json"] = file_sha256(state_file)
    (step / "checksums.json").write_text(json.dumps(sums))
    config = small_config(run, tiny_model_dir, prompt_files, "train.iterations=2")
    with pytest.raises(CheckpointError, match=r"metric name '\.\./\.\./escaped', not group/name"):
        train(config, loggers=[DVCLiveLogger(run / "metrics")])
    assert not list(tmp_path.rglob("escaped*"))
    # and the logger itself refuses such a name, whoever passes it
    with pytest.raises(ValueError, match="not group/name"):
        DVCLiveLogger(tmp_path / "metrics").log(1, {"../x": 1.0})
    assert not (tmp_path / "x.tsv").exists()


def test_outputs_carry_config_and_lineage(tmp_path, tiny_model_dir, prompt_files):
    summary = train(small_config(tmp_path, tiny_model_dir, prompt_files, "train.iterations=1"))
    out = summary.output_dir
    assert (out / "ppo_config.yaml").is_file() and (out / "tokenizer.json").is_file()
    info = json.loads((out / "training_summary.json").read_text())
    assert info["train_file"] == str(prompt_files[0]) and info["iterations"] == 1
    for key in (
        "rollout/score",
        "rollout/kl",
        "ppo/approx_kl",
        "ppo/clipfrac",
        "ppo/entropy",
        "ppo/value_loss",
        "perf/tokens_per_s",
    ):
        assert key in summary.final_metrics
    # The candidate and the checkpoints are DVC outputs: no wall-clock time is written into
    # them, so that the same inputs give the same bytes (the loggers still get the timings).
    assert "rollout/score" in info["final_metrics"]
    assert not [name for name in info["final_metrics"] if name.startswith("perf/")]
    (checkpoint,) = (tmp_path / "checkpoints").glob("step-*")
    history = json.loads((checkpoint / "trainer_state.json").read_text())["history"]
    assert history and not [name for row in history for name in row if name.startswith("perf/")]


@pytest.mark.parametrize(
    "case", ["missing_model", "malformed_prompts", "reward", "reference_tokenizer"]
)
def test_bad_input_fails_clearly_and_writes_nothing(tmp_path, tiny_model_dir, prompt_files, case):
    """Inputs read by the run itself; config errors (a typo, sizes that do not nest) fail at
    load time and are tested in tests/config/test_config.py."""
    bad_prompts = tmp_path / "bad.jsonl"
    bad_prompts.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    if case == "reference_tokenizer":
        build_tiny_llama(tmp_path / "llama")
    overrides = {
        "missing_model": (f"model.policy={tmp_path / 'nope'}",),
        "malformed_prompts": (f"data.train_file={bad_prompts}",),
        "reward": ("model.reward=tests.training.test_trainer:wrong_length_reward",),
        "reference_tokenizer": (f"model.reference={tmp_path / 'llama'}",),
    }[case]
    error = {
        "missing_model": ModelFolderError,
        "malformed_prompts": PromptFileError,
        "reward": RewardError,
        "reference_tokenizer": ModelFolderError,
    }[case]
    message = {
        "missing_model": "model.policy folder .*nope.* does not exist",
        "malformed_prompts": r"bad.jsonl:2: not valid JSON",
        "reward": r"wrong_length_reward.*returned shape \(3,\) for 16 responses",
        "reference_tokenizer": r"model.reference .*llama \(llama, \d+ tokens\) has another "
        r"tokenizer than model.policy .*\(gpt2, \d+ tokens\): their vocabularies differ",
    }[case]
    with pytest.raises(error, match=message):
        train(small_config(tmp_path, tiny_model_dir, prompt_files, *overrides))
    assert not (tmp_path / "candidate").exists()
    assert not (tmp_path / "checkpoints").exists()


def test_a_foreign_folder_as_output_fails_before_training(tmp_path, tiny_model_dir, prompt_files):
    from ppo_core.files import ForeignFolderError

    foreign = tmp_path / "candidate"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("kept")
    with pytest.raises(ForeignFolderError, match="candidate"):
        train(small_config(tmp_path, tiny_model_dir, prompt_files))
    assert not (tmp_path / "checkpoints").exists()  # stopped before the first iteration
    assert (foreign / "notes.txt").read_text() == "kept"


def wrong_length_reward(prompts, responses):
    return [0.0, 1.0, 2.0]


def test_a_changed_config_starts_over_and_keeps_the_old_checkpoints(
    tmp_path, tiny_model_dir, prompt_files
):
    train(small_config(tmp_path, tiny_model_dir, prompt_files, "train.iterations=1"))
    with pytest.warns(UserWarning, match=r"config differs in ppo.epochs \(2 -> 1\)"):
        summary = train(small_config(tmp_path, tiny_model_dir, prompt_files, "ppo.epochs=1"))
    assert summary.resumed_from == 0
    stale = list((tmp_path / "checkpoints").glob("stale-*/step-000001"))
    assert len(stale) == 1


def test_set_aside_runs_are_bounded_and_the_warning_says_what_happens(
    tmp_path, tiny_model_dir, prompt_files
):
    one = ("train.iterations=1", "train.keep_set_aside=1")
    train(small_config(tmp_path, tiny_model_dir, prompt_files, *one))
    with pytest.warns(
        UserWarning,
        match=r"training starts over from model.policy and the old "
        r"checkpoints were moved to .*stale-[0-9-]+\. To continue the old run",
    ):
        train(small_config(tmp_path, tiny_model_dir, prompt_files, *one, "ppo.epochs=1"))
    first = sorted((tmp_path / "checkpoints").glob("stale-*"))
    assert len(first) == 1
    with pytest.warns(
        UserWarning,
        match=rf"removed the oldest set-aside runs {first[0].name} "
        r"\(train.keep_set_aside=1\)",
    ):
        train(small_config(tmp_path, tiny_model_dir, prompt_files, *one, "ppo.epochs=3"))
    second = sorted((tmp_path / "checkpoints").glob("stale-*"))
    assert len(second) == 1 and second != first
    assert (second[0] / "step-000001").is_dir()


def test_separate_critic_adaptive_kl_and_dual_clip_run(tmp_path, tiny_model_dir, prompt_files):
    recorder = Recorder()
    summary = train(
        small_config(
            tmp_path,
            tiny_model_dir,
            prompt_files,
            "model.critic=separate",
            "kl.adaptive=true",
            "kl.target=1.0",
            "kl.horizon=100",
            "ppo.dual_clip=3.0",
            "ppo.missing_eos_penalty=1.0",
            "ppo.loss_agg_mode=seq-mean-token-mean",
        ),
        loggers=[recorder],
    )
    assert (summary.output_dir / "critic" / "model.safetensors").is_file()
    coefs = [m["rollout/kl_coef"] for _, m in recorder.rows]
    assert coefs[0] == pytest.approx(0.1) and coefs[1] != coefs[0]  # adapted after iteration 1
    assert "ppo/dual_clipfrac" in recorder.rows[0][1]


def test_reward_model_folder(tmp_path, tiny_model_dir, prompt_files):
    """A sequence-classification reward model from a local folder scores the rollouts."""
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_layer=1,
        n_embd=16,
        n_head=2,
        n_positions=64,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    reward_dir = tmp_path / "reward-model"
    GPT2ForSequenceClassification(config).save_pretrained(reward_dir)
    tokenizer.save_pretrained(reward_dir)
    recorder = Recorder()
    train(
        small_config(
            tmp_path,
            tiny_model_dir,
            prompt_files,
            f"model.reward={reward_dir}",
            "train.iterations=1",
        ),
        loggers=[recorder],
    )
    score = recorder.rows[0][1]["rollout/score"]
    assert math.isfinite(score)
    # The same seed samples the same first rollout whatever the reward; record it, then check
    # that the logged score is the reward model's own mean score of those responses.
    RECORDED.clear()
    train(
        small_config(
            tmp_path / "recorded",
            tiny_model_dir,
            prompt_files,
            "model.reward=tests.helpers:recording_reward",
            "train.iterations=1",
        )
    )
    prompts, responses = RECORDED[0]
    expected = build_reward_fn(str(reward_dir))(prompts, responses).mean().item()
    assert score == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert len(set(responses)) > 1  # a real batch, not one repeated text


def raising_reward(prompts, responses):
    raise RuntimeError("scorer backend is down")


def test_a_reward_that_raises_is_named(tmp_path, tiny_model_dir, prompt_files):
    with pytest.raises(
        RewardError, match=r"raising_reward.*raised RuntimeError: scorer backend is down"
    ):
        train(
            small_config(
                tmp_path,
                tiny_model_dir,
                prompt_files,
                "model.reward=tests.training.test_trainer:raising_reward",
            )
        )
    assert not (tmp_path / "checkpoints").exists()


def nan_reward(prompts, responses):
    return [float("nan")] * len(prompts)


def test_a_nan_reward_stops_before_any_update(tmp_path, tiny_model_dir, prompt_files):
    with pytest.raises(RewardError, match=r"nan_reward.*returned NaN or inf for responses \[0, 1"):
        train(
            small_config(
                tmp_path,
                tiny_model_dir,
                prompt_files,
                "model.reward=tests.training.test_trainer:nan_reward",
            )
        )
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "candidate").exists()


def test_a_damaged_checkpoint_is_skipped_for_the_previous_good_one(
    tmp_path, tiny_model_dir, prompt_files
):
    reference = tmp_path / "reference"
    train(small_config(reference, tiny_model_dir, prompt_files))
    run = tmp_path / "run"
    train(small_config(run, tiny_model_dir, prompt_files))
    weights = run / "checkpoints" / "step-000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, as by a full disk
    (run / "candidate").rename(run / "old-candidate")
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoint step-000002: .*damaged"):
        summary = train(small_config(run, tiny_model_dir, prompt_files))
    assert summary.resumed_from == 1
    assert (
        max_relative_difference(parameters(run / "candidate"), parameters(reference / "candidate"))
        == 0.0
    )


def test_a_non_finite_gradient_stops_the_step_and_names_the_parameter():
    from ppo_core.training.update import NonFiniteError, clip_and_check_gradients

    layer = torch.nn.Linear(2, 2)
    layer.weight.grad = torch.tensor([[1.0, float("nan")], [0.0, 0.0]])
    layer.bias.grad = torch.zeros(2)
    before = layer.weight.detach().clone()
    with pytest.raises(NonFiniteError, match=r"first non-finite gradient: weight"):
        clip_and_check_gradients(
            list(layer.parameters()), 1.0, {id(p): n for n, p in layer.named_parameters()}
        )
    assert torch.equal(layer.weight.detach(), before)


def test_a_second_run_on_the_same_checkpoints_refuses_to_start(
    tmp_path, tiny_model_dir, prompt_files
):
    from ppo_core.files import RunLockedError, exclusive_run

    first_run = exclusive_run(tmp_path / ".checkpoints.lock", "training run")
    refused = pytest.raises(
        RunLockedError, match=r"another training run on .*checkpoints is running \(pid \d+"
    )
    with first_run, refused:
        train(small_config(tmp_path, tiny_model_dir, prompt_files))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "candidate").exists()
    train(small_config(tmp_path, tiny_model_dir, prompt_files, "train.iterations=1"))  # free again


def test_a_non_finite_loss_is_named_before_the_optimizer_step(tiny_model_dir):
    from ppo_core.config import PPOConfig
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.generation import encode_prompts
    from ppo_core.models.policy import load_actor_critic
    from ppo_core.training.batch import RolloutBatch
    from ppo_core.training.update import NonFiniteError, ppo_update

    model = load_actor_critic(tiny_model_dir)
    prompt_ids, prompt_mask = encode_prompts(load_tokenizer(tiny_model_dir), ["The film", "A plot"])
    response = torch.randint(4, 200, (2, 5))
    zeros = torch.zeros(2, 5)
    advantages = torch.zeros(2, 5)
    advantages[1, 2] = float("inf")  # a valid position: the loss cannot be finite
    batch = RolloutBatch(
        prompt_ids,
        prompt_mask,
        response,
        torch.ones(2, 5, dtype=torch.bool),
        zeros,
        zeros,
        zeros,
        torch.zeros(2),
        zeros,
        advantages,
        zeros,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        NonFiniteError, match=r"policy loss term; non-finite rollout inputs: advantages"
    ):
        ppo_update(
            model,
            optimizer,
            batch,
            ppo=PPOConfig(epochs=1, mini_batch_size=2, micro_batch_size=1),
            temperature=1.0,
            generator=torch.Generator().manual_seed(0),
        )
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("case", ["reward", "model", "data"])
def test_a_run_that_fails_its_checks_after_a_completed_run_keeps_everything(
    tmp_path, tiny_model_dir, prompt_files, case
):
    """A typo in the reward, a missing model folder or a damaged prompt file changes the config,
    yet fails before the finished run's checkpoints are set aside or its output touched."""
    train(small_config(tmp_path, tiny_model_dir, prompt_files))

    def snapshot() -> dict[str, bytes]:
        return {
            str(p.relative_to(tmp_path)): p.read_bytes()
            for folder in ("checkpoints", "candidate")
            for p in sorted((tmp_path / folder).rglob("*"))
            if p.is_file()
        }

    before = snapshot()
    bad_prompts = tmp_path / "bad.jsonl"
    bad_prompts.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    override, error = {
        "reward": ("model.reward=no_such_reward_module:score", RewardError),
        "model": (f"model.policy={tmp_path / 'missing-model'}", ModelFolderError),
        "data": (f"data.train_file={bad_prompts}", PromptFileError),
    }[case]
    with pytest.raises(error):
        train(small_config(tmp_path, tiny_model_dir, prompt_files, override))
    assert snapshot() == before
    assert not list((tmp_path / "checkpoints").glob("stale-*"))
    # the lock was let go: the original run resumes at its end and changes nothing
    summary = train(small_config(tmp_path, tiny_model_dir, prompt_files))
    assert summary.resumed_from == 2


def test_a_bf16_reference_rounds_the_kl_term_only_slightly(tmp_path, tiny_model_dir, prompt_files):
    """model.reference_dtype=bf16 loads the reference's weights in bf16 (half the bytes); at the
    first iteration policy and reference are the same model, so the fp32 KL is exactly 0 and
    the bf16 one is the rounding alone (bench/reference_dtype.py measures it on a trained run)."""
    from ppo_core.experience.judges import load_reference

    kl = {}
    for dtype in ("fp32", "bf16"):
        config = small_config(
            tmp_path / dtype,
            tiny_model_dir,
            prompt_files,
            "train.iterations=1",
            f"model.reference_dtype={dtype}",
        )
        reference = load_reference(config.model, torch.device("cpu"))
        assert {p.dtype for p in reference.parameters()} == {
            torch.bfloat16 if dtype == "bf16" else torch.float32
        }
        kl[dtype] = train(config).history[0]["rollout/kl"]
    assert kl["fp32"] == 0.0
    assert 0.0 < abs(kl["bf16"]) < 0.05


def test_resuming_on_another_number_of_ranks_compares_the_global_batch_sizes():
    """Batch sizes are per rank: a checkpoint continues a run of the same global sizes on any
    number of ranks, and when they differ the reason says which per-rank size would continue it,
    or that none can."""
    from ppo_core.config import to_yaml
    from ppo_core.training.resume import resume_mismatch

    def sizes(rollout: int, mini: int):
        return load_config(
            overrides=[
                f"ppo.rollout_batch_size={rollout}",
                f"ppo.mini_batch_size={mini}",
                "ppo.micro_batch_size=2",
            ]
        )

    state = {"data_hash": "h", "config": to_yaml(sizes(8, 4)), "world_size": 2, "iteration": 1}
    assert resume_mismatch(sizes(16, 8), state, "h", world_size=1) is None  # 16 and 8 in all
    assert resume_mismatch(sizes(4, 2), state, "h", world_size=4) is None
    reason = resume_mismatch(sizes(8, 4), state, "h", world_size=1)
    assert reason is not None
    assert "ppo.rollout_batch_size ('16 in all' -> '8 in all')" in reason
    assert "ppo.rollout_batch_size=16 continues it on 1 rank" in reason
    assert "ppo.mini_batch_size=8 continues it on 1 rank" in reason
    reason = resume_mismatch(sizes(6, 2), state, "h", world_size=3)
    assert reason is not None
    assert "the old run's 16 in all does not divide over 3 ranks" in reason
    # the same number of ranks: no hint, the sizes were changed on purpose
    reason = resume_mismatch(sizes(4, 4), state, "h", world_size=2)
    assert reason is not None and "continues it" not in reason


def test_a_checkpoint_from_before_a_key_existed_resumes_at_its_default():
    """A key the checkpoint's recorded config lacks (added to the code after it was written)
    counts at its default: an upgrade resumes; setting it to something else does not, naming
    it; the engine's own resource settings never stop a resume."""
    import yaml

    from ppo_core.config import to_yaml
    from ppo_core.training.resume import resume_mismatch

    recorded = yaml.safe_load(to_yaml(load_config()))
    del recorded["generation"]["engine"], recorded["ppo"]["tis_cap"]  # an older checkpoint
    state = {"data_hash": "h", "config": yaml.safe_dump(recorded), "iteration": 1}
    assert resume_mismatch(load_config(), state, "h") is None
    reason = resume_mismatch(load_config(overrides=["generation.engine=vllm"]), state, "h")
    assert reason is not None and "generation.engine ('loop' -> 'vllm')" in reason
    moved = load_config(overrides=["generation.vllm_python=/elsewhere/python"])
    assert resume_mismatch(moved, state, "h") is None


def test_new_tokens_past_the_models_positions_are_refused_before_anything_is_written(
    tmp_path, tiny_model_dir, prompt_files
):
    """The tiny default has 64 positions: the longest prompt plus 100 new tokens would fail
    mid-run with an IndexError; the run is refused at its start, naming the key and the
    model's own limit, with nothing written."""
    from ppo_core.config import ConfigError

    config = small_config(tmp_path, tiny_model_dir, prompt_files, "generation.max_new_tokens=100")
    with pytest.raises(
        ConfigError,
        match=r"tokens\) plus generation.max_new_tokens=100 is \d+ positions, more than the 64",
    ):
        train(config)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "candidate").exists()


def test_train_takes_the_prompt_bound_validate_held_the_data_to(
    tmp_path, tiny_model_dir, prompt_files
):
    """Data recorded as validated with ``validation.max_tokens=4`` (its ``validated_with.json``)
    and a run with the default 32: train adopts 4, says so, and refuses the prompts longer
    than it before anything is written (with 32 the run would start)."""
    from ppo_core.config import ConfigError
    from ppo_core.experience.sampling import BoundAdoptedWarning

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_bytes(prompt_files[0].read_bytes())
    (data / "manifest.json").write_text(json.dumps({"content_hash": "v1"}))
    (data / "validated_with.json").write_text(json.dumps({"max_tokens": 4, "data_hash": "v1"}))
    config = small_config(tmp_path, tiny_model_dir, (data / "train.jsonl", prompt_files[1]))
    assert config.validation.max_tokens == 32
    with (
        pytest.warns(BoundAdoptedWarning, match="using 4"),
        pytest.raises(
            ConfigError,
            match=r"train.jsonl: prompt \d+ is \d+ tokens, more than "
            r"validation.max_tokens=4",
        ),
    ):
        train(config)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "candidate").exists()


def test_the_reward_gets_each_drawn_rows_own_answer(tmp_path, tiny_model_dir, prompt_files):
    """Rows with an ``answer`` field: each iteration draws prompts with replacement, four
    samples each, and the reward (``tests.helpers:aligned_answer_reward``, which raises on an
    answer that is not its prompt's) receives each row's own answer as a keyword."""
    from ppo_core.prompts import load_prompts
    from tests.helpers import answer_of

    rows = [{"prompt": p, "answer": answer_of(p)} for p in load_prompts(prompt_files[0])]
    train_file = tmp_path / "answers.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = train(
        small_config(
            tmp_path,
            tiny_model_dir,
            (train_file, prompt_files[1]),
            "data.reference_fields=[answer]",
            "model.reward=tests.helpers:aligned_answer_reward",
            "ppo.advantage_estimator=grpo",
            "model.critic=none",
            "ppo.samples_per_prompt=4",
        )
    )
    assert len(summary.history) == 2 and "rollout/score" in summary.final_metrics


def test_a_verifier_rewards_reasons_and_failures_are_logged(tmp_path, tiny_model_dir, prompt_files):
    """``builtin:exact_match`` against each row's answer: the rollout logs the share of each
    verdict reason and ``reward/verifier_errors``; a verifier that failed on replies (a
    timeout, an error) is counted there, its replies scored 0.0, and the run goes on."""
    from ppo_core.prompts import load_prompts
    from ppo_core.training.rollout import verdict_metrics
    from tests.helpers import answer_of

    rows = [{"prompt": p, "answer": answer_of(p)} for p in load_prompts(prompt_files[0])]
    train_file = tmp_path / "answers.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = small_config(
        tmp_path,
        tiny_model_dir,
        (train_file, prompt_files[1]),
        "data.reference_fields=[answer]",
        "model.reward=builtin:exact_match",
        "train.iterations=1",
    )
    metrics = train(config).final_metrics
    reasons = {k: v for k, v in metrics.items() if k.startswith(("reward/", "verdict/"))}
    assert reasons["reward/verifier_errors"] == 0.0
    shares = [v for k, v in reasons.items() if k.startswith("verdict/")]
    assert shares and sum(shares) == pytest.approx(1.0), reasons

    class Failing:  # what a verifier that timed out on one reply and failed on another records
        def __init__(self) -> None:
            self.last_reasons = {"correct": 2, "wrong": 4, "timeout": 1, "error": 1}

    counted = verdict_metrics(Failing(), all_ranks=False)
    assert counted["reward/verifier_errors"] == 2.0
    assert counted["verdict/timeout"] == 0.125 and counted["verdict/wrong"] == 0.5
    assert verdict_metrics(lambda prompts, responses: None, all_ranks=False) == {}


def test_several_rewards_are_weighed_and_each_is_logged(tmp_path, tiny_model_dir, prompt_files):
    """``model.reward`` plus a term of ``model.reward_terms``, weights 1 and 0.5: the rollout's
    score is ``reward/exact_match + 0.5 * reward/varied_reward`` (the logged means), and the
    candidate records the terms it was trained with."""
    from ppo_core.prompts import load_prompts
    from tests.helpers import answer_of

    rows = [{"prompt": p, "answer": answer_of(p)} for p in load_prompts(prompt_files[0])]
    train_file = tmp_path / "answers.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = small_config(
        tmp_path,
        tiny_model_dir,
        (train_file, prompt_files[1]),
        "data.reference_fields=[answer]",
        "model.reward=builtin:exact_match",
        "model.reward_terms=[tests.helpers:varied_reward]",
        "model.reward_weights=[1.0,0.5]",
        "train.iterations=1",
    )
    metrics = train(config).final_metrics
    exact, varied = metrics["reward/exact_match"], metrics["reward/varied_reward"]
    assert varied > 0.0  # the term scored something, so its weight shows in the sum
    assert metrics["rollout/score"] == pytest.approx(exact + 0.5 * varied, abs=1e-6)
    assert "reward/verifier_errors" in metrics  # the verifier's reasons still reach the logs
    summary = json.loads((tmp_path / "candidate" / "training_summary.json").read_text())
    assert summary["reward_terms"] == ["tests.helpers:varied_reward"]
    assert summary["reward_weights"] == [1.0, 0.5]


def test_reasoning_gym_rows_train_with_their_tasks_own_scorer(
    tmp_path, tiny_model_dir, prompt_files
):
    """Rows written by ``ppo tasks`` (answer, task and a metadata object a row) train with
    ``builtin:reasoning_gym``: every reply of the tiny model is judged (its verdict shares
    sum to 1) and none failed the scorer."""
    from ppo_core.rewards.gym import GYM_FIELDS, gym_rows

    train_file = tmp_path / "tasks.jsonl"
    rows = gym_rows(["chain_sum", "word_sorting"], size=8, seed=0)
    # short prompts for the 64-position test model; the fields are the rows' own
    rows = [{**row, "prompt": f"problem {i}"} for i, row in enumerate(rows)]
    train_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = small_config(
        tmp_path,
        tiny_model_dir,
        (train_file, prompt_files[1]),
        f"data.reference_fields=[{','.join(GYM_FIELDS)}]",
        "model.reward=builtin:reasoning_gym",
        "train.iterations=1",
    )
    metrics = train(config).final_metrics
    shares = [v for k, v in metrics.items() if k.startswith("verdict/")]
    assert shares and sum(shares) == pytest.approx(1.0), metrics
    assert metrics["reward/verifier_errors"] == 0.0


@pytest.mark.parametrize("case", ["another base", "no recorded base"])
def test_a_checkpoint_of_another_or_an_unrecorded_base_is_not_resumed(
    tmp_path, tiny_model_dir, prompt_files, case
):
    """Full weights (no LoRA, whose adapter checks its own base): the next generation's base
    under the same model.policy path, or a checkpoint from before the base's fingerprint was
    recorded, is set aside and the run starts over, saying why."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ppo_core.files import file_sha256

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    run = tmp_path / "run"
    train(small_config(run, base, prompt_files, "train.iterations=1"))
    checkpoint = run / "checkpoints" / "step-000001"
    if case == "another base":
        weights = load_file(str(base / "model.safetensors"))
        save_file({k: v + 0.01 for k, v in weights.items()}, str(base / "model.safetensors"))
        why = "it was trained from another model.policy"
    else:  # as a checkpoint written before base_sha256 was recorded
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        del state["base_sha256"]
        (checkpoint / "trainer_state.json").write_text(json.dumps(state))
        sums = json.loads((checkpoint / "checksums.json").read_text())
        sums["trainer_state.json"] = file_sha256(checkpoint / "trainer_state.json")
        (checkpoint / "checksums.json").write_text(json.dumps(sums))
        why = "it records no fingerprint of the model.policy it was trained from"
    with pytest.warns(UserWarning, match=f"not resuming from .*step-000001: {why}"):
        summary = train(small_config(run, base, prompt_files, "train.iterations=2"))
    assert not summary.resumed_from  # 0: started over
