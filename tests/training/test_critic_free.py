"""The critic-free advantage estimators end to end on a real (tiny) GPT-2: no value model is
built, run or saved; grouped sampling; the exact update and resume with ``grpo``; the KL as a
loss term; and the config errors of the combinations that cannot work."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from safetensors.torch import load_file

from ppo_core.config import ConfigError, load_config
from ppo_core.parallel.process_group import DataParallel
from ppo_core.prompts import load_prompts
from ppo_core.training.loop import RandomStream, draw_prompts, stream_seed, train
from tests.helpers import (
    Recorder,
    max_relative_difference,
    parameters,
    parameters_after_one_sgd_iteration,
    small_config,
)

GRPO = ["ppo.advantage_estimator=grpo", "model.critic=none", "ppo.samples_per_prompt=4"]
VALUE_METRICS = ("ppo/value_loss", "ppo/vf_clipfrac", "rollout/value_mean")


def test_grpo_micro_batch_size_does_not_change_the_update(tmp_path, tiny_model_dir, prompt_files):
    """As ``test_micro_batch_size_does_not_change_the_update``, with group-normalised scores and
    no critic: micro-batches of 1 and 8 rows reach the same weights after one SGD iteration."""
    results = parameters_after_one_sgd_iteration(tmp_path, tiny_model_dir, prompt_files, *GRPO)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert results[8].keys() == base.keys()  # the policy only: no value head
    assert max_relative_difference(results[8], base) > 1e-4
    # float32 round-off, larger than GAE's (the group statistics divide by a small standard
    # deviation): measured 6.4e-5 (2.9e-5 on an earlier build); the bound is about 8x that
    assert max_relative_difference(results[1], results[8]) <= 5e-4


def test_grpo_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_dir, prompt_files):
    full = small_config(
        tmp_path / "full", tiny_model_dir, prompt_files, "train.iterations=3", *GRPO
    )
    train(full)
    part = tmp_path / "part"
    train(small_config(part, tiny_model_dir, prompt_files, "train.iterations=1", *GRPO))
    summary = train(small_config(part, tiny_model_dir, prompt_files, "train.iterations=3", *GRPO))
    assert summary.resumed_from == 1
    one, two = parameters(part / "candidate"), parameters(tmp_path / "full" / "candidate")
    assert max_relative_difference(one, two) == 0.0


@pytest.mark.parametrize(
    "estimator",
    [
        ["rloo", "ppo.samples_per_prompt=2"],
        ["dr_grpo", "ppo.samples_per_prompt=2", "ppo.loss_agg_mode=seq-mean-token-sum"],
        ["reinforce_pp", "ppo.whiten_advantages=false"],
    ],
)
def test_a_critic_free_run_builds_runs_and_saves_no_value_model(
    tmp_path, tiny_model_dir, prompt_files, estimator
):
    name, *extra = estimator
    recorder = Recorder()
    summary = train(
        small_config(
            tmp_path,
            tiny_model_dir,
            prompt_files,
            f"ppo.advantage_estimator={name}",
            "model.critic=none",
            *extra,
        ),
        loggers=[recorder],
    )
    for _, metrics in recorder.rows:
        assert not set(VALUE_METRICS) & metrics.keys()  # absent, not zero
        assert math.isfinite(metrics["ppo/policy_loss"])
    for folder in (summary.output_dir, tmp_path / "checkpoints" / "step-000002" / "model"):
        assert folder.is_dir()
        assert not (folder / "value_head.safetensors").exists()
        assert not (folder / "critic").exists()
    # the optimizer holds the policy's parameters only
    optimizer = torch.load(
        tmp_path / "checkpoints" / "step-000002" / "optimizer.pt", weights_only=True
    )
    policy = load_file(str(summary.output_dir / "model.safetensors"))
    held = len(optimizer["param_groups"][0]["params"])
    assert held == len(policy) or held == len(policy) + 1  # GPT-2 ties lm_head to wte
    saved = json.loads((summary.output_dir / "training_summary.json").read_text())
    assert "rollout/value_mean" not in saved["final_metrics"]


def test_the_kl_in_the_loss_leaves_the_reward_to_the_score(tmp_path, tiny_model_dir, prompt_files):
    recorder = Recorder()
    train(
        small_config(
            tmp_path,
            tiny_model_dir,
            prompt_files,
            *GRPO,
            "kl.in_loss=true",
            "kl.estimator=k3",
            "train.iterations=2",
        ),
        loggers=[recorder],
    )
    second = recorder.rows[1][1]
    # by iteration 2 the policy has moved, so the KL is not 0, yet the reward is the score alone
    assert second["rollout/kl"] > 1e-6
    assert second["rollout/reward"] == pytest.approx(second["rollout/score"], abs=1e-6)
    assert second["ppo/kl_loss"] > 0  # k3 >= 0, and > 0 once the policy differs
    # with the KL in the reward instead, the two differ by -beta * KL
    in_reward = Recorder()
    train(small_config(tmp_path / "b", tiny_model_dir, prompt_files, *GRPO), loggers=[in_reward])
    row = in_reward.rows[1][1]
    assert "ppo/kl_loss" not in row
    assert row["rollout/reward"] == pytest.approx(
        row["rollout/score"] - row["rollout/kl_coef"] * row["rollout/kl"], abs=1e-5
    )


def test_groups_are_consecutive_and_whole_on_each_rank(tiny_model_dir, prompt_files):
    """Each drawn prompt fills ``samples_per_prompt`` consecutive rows; a rank's rows are whole
    groups, and 2 ranks hold together exactly the rows of 1 rank drawing the global batch."""
    prompts = load_prompts(prompt_files[0], "prompt")

    def drawn(rollout: int, group: int, rank: int, world_size: int):
        config = load_config(
            overrides=[
                f"ppo.rollout_batch_size={rollout}",
                "ppo.mini_batch_size=4",
                "ppo.micro_batch_size=4",
                f"ppo.samples_per_prompt={group}",
            ]
        )
        return draw_prompts(prompts, config, 3, DataParallel(rank=rank, world_size=world_size))

    one = drawn(16, 4, 0, 1)
    assert all(one[i] == one[i - i % 4] for i in range(16))  # groups of 4 in a row
    assert len({str(one[i]) for i in range(0, 16, 4)}) > 1  # of different prompts
    assert drawn(8, 4, 0, 2) + drawn(8, 4, 1, 2) == one
    # one sample a prompt draws as before groups existed: the committed runs are unchanged
    config = load_config(
        overrides=["ppo.rollout_batch_size=16", "ppo.mini_batch_size=4", "ppo.micro_batch_size=4"]
    )
    generator = torch.Generator().manual_seed(stream_seed(0, 3, RandomStream.PROMPT_DRAW))
    picks = torch.randint(len(prompts), (16,), generator=generator).tolist()
    assert draw_prompts(prompts, config, 3, DataParallel(rank=0, world_size=1)) == [
        prompts[i] for i in picks
    ]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["ppo.samples_per_prompt=3"], ["ppo.samples_per_prompt=3", "ppo.rollout_batch_size=64"]),
        (["ppo.samples_per_prompt=0"], ["ppo.samples_per_prompt=0"]),
        (
            ["ppo.advantage_estimator=grpo"],
            ["ppo.advantage_estimator=grpo", "model.critic=shared", "model.critic=none"],
        ),
        (
            ["ppo.advantage_estimator=rloo", "model.critic=none"],
            ["ppo.advantage_estimator=rloo", "ppo.samples_per_prompt >= 2"],
        ),
        (["model.critic=none"], ["ppo.advantage_estimator=gae", "model.critic=none"]),
        (
            ["ppo.advantage_estimator=reinforce_pp", "model.critic=separate"],
            ["model.critic=separate"],
        ),
        (["ppo.advantage_estimator=ppo"], ["ppo.advantage_estimator", "grpo"]),
    ],
)
def test_estimator_settings_that_cannot_work_fail_at_load_time(overrides, named):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    for text in named:
        assert text in str(error.value)


def test_a_critic_free_run_with_lora_trains_the_adapter_only(
    tmp_path, tiny_model_dir, prompt_files
):
    summary = train(
        small_config(
            tmp_path,
            tiny_model_dir,
            prompt_files,
            *GRPO,
            "model.lora.enabled=true",
            "model.lora.rank=4",
            "train.iterations=1",
        )
    )
    assert (summary.output_dir / "adapter_model.safetensors").is_file()
    assert not (summary.output_dir / "value_head.safetensors").exists()


@pytest.mark.parametrize("in_loss", [False, True])
def test_group_estimators_compare_whole_returns_with_the_kl_penalty(
    tiny_model_dir, prompt_files, in_loss
):
    """RLOO's baseline on the rollout's own numbers: each response's return is its score minus
    ``beta`` times the KL of all its tokens when the KL is in the reward, its score alone when
    the KL is in the loss; the advantage is that return minus the mean of the others'."""
    from ppo_core.experience.judges import build_reward
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.policy import load_actor_critic, load_causal_lm
    from ppo_core.parallel.runtime import Runtime
    from ppo_core.training.rollout import collect_rollout

    config = load_config(
        overrides=[
            f"model.policy={tiny_model_dir}",
            "ppo.advantage_estimator=rloo",
            "model.critic=none",
            "ppo.rollout_batch_size=8",
            "ppo.mini_batch_size=8",
            "ppo.micro_batch_size=8",
            "ppo.samples_per_prompt=4",
            "generation.max_new_tokens=6",
            f"kl.in_loss={in_loss}",
        ]
    )
    torch.manual_seed(0)
    policy = load_actor_critic(tiny_model_dir, "none")
    with torch.no_grad():  # a policy that has moved away from its reference: KL > 0
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    prompts = load_prompts(prompt_files[0], "prompt")[:2]
    batch, metrics, _ = collect_rollout(
        policy,
        load_causal_lm(tiny_model_dir, "reference"),
        load_tokenizer(tiny_model_dir),
        [prompts[0]] * 4 + [prompts[1]] * 4,
        build_reward(config.model, torch.device("cpu")),
        ppo=config.ppo,
        generation=config.generation,
        kl=config.kl,
        kl_coef=0.5,
        runtime=Runtime(),
    )
    assert batch.old_values is None and batch.returns is None
    mask = batch.response_mask
    kl = ((batch.old_logprobs - batch.ref_logprobs) * mask).sum(dim=1).double()
    assert kl.abs().max() > 1e-3
    returns = batch.scores.double() - (0.0 if in_loss else 0.5) * kl
    for group in (range(0, 4), range(4, 8)):
        for i in group:
            others = [returns[j] for j in group if j != i]
            expected = returns[i] - sum(others) / 3
            assert batch.advantages[i][mask[i]].double() == pytest.approx(
                [float(expected)] * int(mask[i].sum()), abs=1e-5
            )
    assert "rollout/value_mean" not in metrics


@pytest.mark.parametrize("critic", ["none", "shared", "separate"])
def test_old_logprobs_from_sampling_skip_the_policy_pass_and_match_a_rescore(
    tiny_model_dir, prompt_files, monkeypatch, critic
):
    """``ppo.old_logprobs=sampling``: the rollout's old log-probabilities are the ones the
    sampler kept; with the value head on the policy's trunk the sampling loop gives the values
    too, so the policy's scoring pass runs only for a separate critic; and a rescore of the same
    rollout agrees to float rounding (measured 4.8e-6 at most in the log-probabilities, 1.9e-6
    in the values)."""
    from ppo_core.experience.judges import build_reward
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.policy import load_actor_critic, load_causal_lm
    from ppo_core.parallel.runtime import Runtime
    from ppo_core.training import rollout

    passes = []
    score = rollout.score_in_chunks
    monkeypatch.setattr(
        rollout,
        "score_in_chunks",
        lambda model, *args, **kwargs: passes.append(model) or score(model, *args, **kwargs),
    )
    policy = load_actor_critic(tiny_model_dir, critic)
    if policy.value_head is not None:  # zero-initialised: values that can differ
        torch.manual_seed(3)
        torch.nn.init.normal_(policy.value_head.weight, std=0.3)
    prompts = load_prompts(prompt_files[0], "prompt")[:8]
    batches = {}
    for source in ("sampling", "rescore"):
        config = load_config(
            overrides=[
                f"model.policy={tiny_model_dir}",
                "ppo.advantage_estimator=" + ("rloo" if critic == "none" else "gae"),
                f"model.critic={critic}",
                "ppo.rollout_batch_size=8",
                "ppo.mini_batch_size=8",
                "ppo.micro_batch_size=4",
                "ppo.samples_per_prompt=" + ("2" if critic == "none" else "1"),
                "generation.max_new_tokens=12",
                f"ppo.old_logprobs={source}",
            ]
        )
        passes.clear()
        torch.manual_seed(0)
        batches[source], _, _ = rollout.collect_rollout(
            policy,
            load_causal_lm(tiny_model_dir, "reference"),
            load_tokenizer(tiny_model_dir),
            prompts,
            build_reward(config.model, torch.device("cpu")),
            ppo=config.ppo,
            generation=config.generation,
            kl=config.kl,
            kl_coef=0.1,
            runtime=Runtime(),
            measure_gap=False,  # an iteration without the sampler gap's few rescored rows
        )
        # the reference's pass, and the policy's unless skipped
        assert sum(model is policy for model in passes) == (
            0 if source == "sampling" and critic != "separate" else 1
        )
        assert len(passes) - sum(model is policy for model in passes) == 1
    sampled, rescored = batches["sampling"], batches["rescore"]
    assert torch.equal(sampled.response_ids, rescored.response_ids)
    mask = sampled.response_mask
    torch.testing.assert_close(
        sampled.old_logprobs[mask], rescored.old_logprobs[mask], rtol=0, atol=1e-5
    )
    assert not torch.equal(sampled.old_logprobs[mask], rescored.old_logprobs[mask])
    if critic == "none":
        return
    assert float(rescored.old_values[mask].abs().mean()) > 0.1
    difference = float((sampled.old_values - rescored.old_values)[mask].abs().max())
    assert (difference == 0) == (critic == "separate") and difference < 1e-5, difference


def test_with_sampled_old_logprobs_a_few_rows_are_rescored_for_the_gap(
    tiny_model_dir, prompt_files, monkeypatch
):
    """``ppo.old_logprobs=sampling`` logs the sampler gap too: on an iteration that measures it
    the policy rescores ``ppo.sampler_gap_rows`` rows (a pass of those rows alone), and the
    gap is fp32 noise (the loop against the trainer: measured 1.8e-7 mean, 9.5e-7 largest on
    an AVX-512 EPYC; the bounds allow the 4.8e-6 seen above); on the others nothing is
    rescored or logged."""
    from ppo_core.experience.judges import build_reward
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.policy import load_actor_critic, load_causal_lm
    from ppo_core.parallel.runtime import Runtime
    from ppo_core.training import rollout

    rows_scored: list[tuple[object, int]] = []
    score = rollout.score_in_chunks
    monkeypatch.setattr(
        rollout,
        "score_in_chunks",
        lambda model, generated, *args, **kwargs: (
            rows_scored.append((model, len(generated.response_ids)))
            or score(model, generated, *args, **kwargs)
        ),
    )
    policy = load_actor_critic(tiny_model_dir, "none")
    config = load_config(
        overrides=[
            f"model.policy={tiny_model_dir}",
            "ppo.advantage_estimator=rloo",
            "model.critic=none",
            "ppo.rollout_batch_size=8",
            "ppo.samples_per_prompt=2",
            "ppo.mini_batch_size=8",
            "ppo.micro_batch_size=4",
            "generation.max_new_tokens=12",
            "ppo.old_logprobs=sampling",
            "ppo.sampler_gap_rows=3",
        ]
    )
    inputs = (
        policy,
        load_causal_lm(tiny_model_dir, "reference"),
        load_tokenizer(tiny_model_dir),
        load_prompts(prompt_files[0], "prompt")[:8],
        build_reward(config.model, torch.device("cpu")),
    )
    found = {}
    for measure in (True, False):
        rows_scored.clear()
        _, found[measure], _ = rollout.collect_rollout(
            *inputs,
            ppo=config.ppo,
            generation=config.generation,
            kl=config.kl,
            kl_coef=0.1,
            runtime=Runtime(),
            measure_gap=measure,
        )
        assert [rows for model, rows in rows_scored if model is policy] == ([3] if measure else [])
    print({k: v for k, v in found[True].items() if "sampler" in k})
    assert found[True]["rollout/sampler_gap_mean"] < 1e-5
    assert found[True]["rollout/sampler_gap_max"] < 5e-5
    assert not any("sampler" in name for name in found[False])


def test_a_sampler_gap_past_the_bound_warns_once_naming_the_key():
    """A run whose ``rollout/sampler_gap_mean`` passes ``ppo.sampler_gap_warn`` hears of it
    once, with the likely causes and the keys; below the bound, or with the bound off, not."""
    from ppo_core.training.rollout import SamplerGapWarning, SamplerGapWatch

    config = load_config(overrides=["ppo.old_logprobs=sampling", "generation.engine=vllm"])
    watch = SamplerGapWatch(config.ppo, config.generation, "bf16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch.check(1, {"rollout/sampler_gap_mean": 0.01, "rollout/sampler_gap_max": 0.2})
        assert not caught
        for iteration in (2, 3):
            watch.check(
                iteration, {"rollout/sampler_gap_mean": 0.23, "rollout/sampler_gap_max": 30}
            )
    assert [w.category for w in caught] == [SamplerGapWarning]
    message = str(caught[0].message)
    for named in (
        "0.23",
        "iteration 2",
        "ppo.sampler_gap_warn=0.05",
        "precision=bf16",
        "ppo.tis_cap",
        "ppo.old_logprobs=rescore",
    ):
        assert named in message, (named, message)
    config.ppo.sampler_gap_warn = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SamplerGapWatch(config.ppo, config.generation, "fp32").check(
            1, {"rollout/sampler_gap_mean": 9.0}
        )
    assert not caught
