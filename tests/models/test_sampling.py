"""The sampling loop (:mod:`ppo_core.models.sampling`): the draw inverts the distribution,
the warpers cut it as ``generate`` cuts it, and dropping ended rows changes no row."""

from __future__ import annotations

import pytest
import torch

from ppo_core.models import sampling
from ppo_core.models.causal_lm import load_tokenizer
from ppo_core.models.generation import encode_prompts
from ppo_core.models.policy import load_actor_critic
from ppo_core.models.sampling import NonFiniteSamplingError, draw_from, sample_tokens


def test_the_draw_inverts_the_cumulative_distribution_and_never_draws_a_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(6, 4)
    uniforms = torch.tensor([0.0, 0.25, 0.4999, 0.5, 0.75, 0.9999999])
    assert draw_from(probs, uniforms).tolist() == [1, 1, 1, 3, 3, 3]
    # rows need not sum to one: [2, 6] is [0.25, 0.75]
    assert draw_from(torch.tensor([[2.0, 6.0]] * 2), torch.tensor([0.2499, 0.25])).tolist() == [
        0,
        1,
    ]


def test_drawn_frequencies_follow_the_probabilities():
    """200,000 draws from a fixed distribution, seeded: each frequency within 4 standard
    errors of its probability (measured: at most 2.9)."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.05, 0.0, 0.4, 0.15, 0.3, 0.1])
    n = 200_000
    uniforms = torch.rand(n, generator=generator)
    counts = torch.bincount(draw_from(probs.expand(n, -1), uniforms), minlength=6).double()
    standard_errors = (probs * (1 - probs) / n).sqrt().double()
    z = ((counts / n - probs.double()).abs() / standard_errors.clamp(min=1e-12))[probs > 0]
    assert counts[1] == 0 and z.max() < 4, z


@pytest.mark.parametrize("top_k, top_p", [(2, 1.0), (0, 0.6), (3, 0.5)])
def test_top_k_and_top_p_cut_the_distribution_as_generate_does(top_k, top_p):
    """The tokens a step may draw are those transformers' warpers keep after the temperature;
    the log-probability kept is the uncut one, as the scoring pass computes it."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scaled = logits / 0.7
    if top_k:
        scaled = TopKLogitsWarper(top_k=top_k)(None, scaled)
    if top_p < 1:
        scaled = TopPLogitsWarper(top_p=top_p)(None, scaled)
    allowed = torch.isfinite(scaled)
    warpers = sampling._warpers(0.7, top_k, top_p)
    for _ in range(200):
        token, logprob = sampling._draw_next(logits, torch.rand(4), 0.7, warpers)
        assert allowed.gather(1, token[:, None]).all()
        expected = torch.log_softmax(logits / 0.7, -1).gather(1, token[:, None]).squeeze(1)
        torch.testing.assert_close(logprob, expected, rtol=0, atol=1e-6)


def test_dropping_ended_rows_changes_no_row(tiny_model_dir, monkeypatch):
    """Rows are dropped from the batch and the cache as they end; each row draws its own
    uniform at each step, so the responses are the same whether ended rows are dropped at once
    or computed to the end (log-probabilities within float rounding: measured 1.9e-6)."""
    model = load_actor_critic(tiny_model_dir).policy
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = ["The plot was", "I think", "The movie was", "This film"] * 3
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
    runs = {}
    for fraction in (0.0, 2.0):  # drop at every end; never drop
        monkeypatch.setattr(sampling, "COMPACT_FRACTION", fraction)
        torch.manual_seed(5)
        runs[fraction] = sample_tokens(
            model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=16,
            stop_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
        )
    (dropped_ids, dropped_logprobs, _), (kept_ids, kept_logprobs, _) = runs[0.0], runs[2.0]
    lengths = (dropped_ids != tokenizer.pad_token_id).sum(1)
    assert lengths.min() < lengths.max()  # rows ended at different steps
    assert torch.equal(dropped_ids, kept_ids)
    torch.testing.assert_close(dropped_logprobs, kept_logprobs, rtol=0, atol=1e-5)


def test_a_nan_probability_is_an_error_naming_the_step_and_the_setting(tiny_model_dir):
    """A temperature that scales the logits past float32 (1e-40, which the config's floor now
    refuses, reached here directly) makes the probabilities NaN; the draw then returned the
    last vocabulary token at every step as if sampled. Now it is an error naming the response
    token and the setting; NaN logits from the model itself are named as the model's."""
    logits = torch.randn(4, 50) * 10
    with pytest.raises(NonFiniteSamplingError, match=r"response token 3: .*NaN or inf: "):
        sampling._draw_next(logits, torch.rand(4), 1e-40, [], step=2)
    with pytest.raises(NonFiniteSamplingError, match=r"generation\.temperature=1e-40 scales"):
        sampling._draw_next(logits, torch.rand(4), 1e-40, sampling._warpers(1e-40, 5, 0.9))
    logits[1, 7] = float("nan")
    with pytest.raises(NonFiniteSamplingError, match=r"since the model's logits do"):
        sampling._draw_next(logits, torch.rand(4), 1.0, [])

    model = load_actor_critic(tiny_model_dir).policy
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, ["The plot was", "I think"])
    with pytest.raises(NonFiniteSamplingError, match=r"^sampling response token 1: .*1e-40"):
        sample_tokens(
            model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=8,
            stop_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
            temperature=1e-40,
        )


def test_a_kv_cache_larger_than_the_free_memory_is_refused_before_it_is_allocated(
    tiny_model_dir, monkeypatch
):
    """The cache is allocated once, rows x (prompt + max_new_tokens) x layers: measured
    against the device's free memory first, and refused naming its size and the keys."""
    model = load_actor_critic(tiny_model_dir).policy
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, ["The plot was", "I think"])
    config = model.config
    # keys and values, 2 layers, 2 rows, prompt + 8 positions, n_embd floats of 4 bytes each
    length = prompt_ids.shape[1] + 8
    expected = 2 * config.n_layer * 2 * length * config.n_embd * 4
    assert sampling.kv_cache_bytes(model, 2, length, 4) == expected
    allocated: list[int] = []
    monkeypatch.setattr(sampling, "free_memory_bytes", lambda device: expected - 1)
    monkeypatch.setattr(sampling, "preallocated_cache", lambda *a: allocated.append(1))
    with pytest.raises(sampling.KVCacheTooLargeError, match=r"sampling 2 rows of up to "):
        sample_tokens(
            model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=8,
            stop_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
        )
    assert allocated == []
    assert sampling.free_memory_bytes(torch.device("cpu")) > 0  # this machine's MemAvailable


@pytest.mark.parametrize("compact_fraction", [0.0, 2.0])  # drop at every end; never drop
def test_values_the_loop_gives_are_the_scoring_pass_values(
    tiny_model_dir, monkeypatch, compact_fraction
):
    """With the value head, the loop's value of the state before each sampled token is the
    one the scoring pass computes over the whole sequence (left-padded prompts of different
    lengths, rows ending at different steps): within float rounding (measured 2.4e-6 with
    values of about 1.9)."""
    from ppo_core.models.scoring import score_sequences

    actor_critic = load_actor_critic(tiny_model_dir)
    torch.manual_seed(3)
    torch.nn.init.normal_(actor_critic.value_head.weight, std=0.3)  # zero-initialised: make it see
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = ["The plot was", "I think", "The movie was a very", "This film"] * 3
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
    monkeypatch.setattr(sampling, "COMPACT_FRACTION", compact_fraction)
    torch.manual_seed(5)
    sampled = sample_tokens(
        actor_critic.policy,
        prompt_ids,
        prompt_mask,
        max_new_tokens=16,
        stop_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        value_head=actor_critic.value_head,
    )
    response_mask = sampled.logprobs != 0
    lengths = response_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows ended at different steps
    with torch.no_grad():
        scored = score_sequences(
            actor_critic, prompt_ids, prompt_mask, sampled.response_ids, response_mask
        )
    assert sampled.values is not None and scored.values is not None
    assert float(scored.values[response_mask].abs().mean()) > 0.1  # values that can differ
    difference = float(((sampled.values - scored.values) * response_mask).abs().max())
    assert difference < 1e-5, difference
    assert torch.all(sampled.values[~response_mask] == 0)


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_values_alone_are_the_forward_values_without_the_work_of_the_logits(tiny_model_dir, critic):
    """``ActorCritic.values``, the pass of a rollout whose log-probabilities the sampler gave:
    the values ``forward`` computes, with the output layer cut to the last position on a shared
    trunk and the policy not run at all beside a separate critic."""
    actor_critic = load_actor_critic(tiny_model_dir, critic)
    torch.manual_seed(3)
    torch.nn.init.normal_(actor_critic.value_head.weight, std=0.3)
    tokenizer = load_tokenizer(tiny_model_dir)
    ids, mask = encode_prompts(tokenizer, ["The plot was", "I think the movie was a", "A"])
    policy_runs: list[int] = []  # the positions the output layer was given, one entry a run
    hook = actor_critic.causal_lm.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: policy_runs.append(args[0].shape[1])
    )
    with torch.no_grad():
        _, values = actor_critic(ids, mask)
        alone = actor_critic.values(ids, mask)
    hook.remove()
    assert policy_runs == ([ids.shape[1], 1] if critic == "shared" else [ids.shape[1]])
    real = mask.bool()
    assert float(values[real].abs().mean()) > 0.1
    torch.testing.assert_close(alone[real], values[real], rtol=0, atol=1e-6)
