"""Model families besides GPT-2 (Llama, Qwen2, Mistral, GPT-NeoX) and tokenizers as real
checkpoints ship them: positions under left padding, the exact fast paths and only those, the
exact micro-batched update, resume, and a reward model with a tokenizer of its own."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from ppo_core.models.causal_lm import PadTokenWarning, load_tokenizer, position_ids_from_mask
from ppo_core.models.generation import encode_prompts, response_mask_from_ids
from ppo_core.models.policy import load_actor_critic, load_causal_lm
from ppo_core.models.sampling import sample_tokens
from ppo_core.models.scoring import score_sequences
from ppo_core.training.loop import train
from tests.helpers import (
    FAMILIES,
    RECORDED,
    VARIED,
    Recorder,
    build_tiny_causal_lm,
    max_relative_difference,
    parameters,
    parameters_after_one_sgd_iteration,
    small_config,
)

PROMPTS = ["The movie was", "Honestly, I thought the acting", "This film"]

# (family, pad, embedding rows): the tiny default GPT-2 and each family with a pad token of its
# own; Qwen2 as it ships (pad = EOS, an embedding of 151936 rows, far more than its tokenizer
# has); Llama as it ships (no pad token at all).
CASES = (
    [("gpt2", "own", 0)]
    + [(family, "own", 0) for family in FAMILIES]
    + [
        ("qwen2", "eos", 151936),
        ("llama", "none", 0),
    ]
)


def case_id(case: tuple[str, str, int]) -> str:
    family, pad, rows = case
    return f"{family}-pad_{pad}" + (f"-vocab_{rows}" if rows else "")


@pytest.fixture(scope="session")
def family_models(tmp_path_factory, tiny_model_dir):
    """Model folders by case, built on first use."""
    built: dict[tuple[str, str, int], object] = {("gpt2", "own", 0): tiny_model_dir}

    def folder(case: tuple[str, str, int]):
        if case not in built:
            family, pad, rows = case
            path = tmp_path_factory.mktemp("families") / case_id(case)
            built[case] = build_tiny_causal_lm(path, family, pad=pad, model_vocab_size=rows)
        return built[case]

    return folder


def load_quietly(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PadTokenWarning)
        return load_actor_critic(folder), load_tokenizer(folder)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_sampled_and_recomputed_logprobs_agree_with_positions_from_the_mask(family_models, case):
    """Generation and scoring see the same positions (docs/design.md section 8), and the
    log-probabilities (and values) the sampler keeps are those the scoring pass recomputes. On
    RoPE models a constant shift of every position changes no logit, so the logprobs alone could
    not catch a wrong offset: the positions handed to the model are checked too."""
    model, tokenizer = load_quietly(family_models(case))
    torch.manual_seed(0)
    torch.nn.init.normal_(model.value_head.weight, std=0.3)  # zero-initialised: make it see
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS)
    assert (prompt_mask[:, 0] == 0).any(), "prompts of different lengths should be left-padded"
    seen: list[torch.Tensor] = []
    hook = model.policy.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("position_ids")), with_kwargs=True
    )
    response, sampled, values = sample_tokens(
        model.policy,
        prompt_ids,
        prompt_mask,
        max_new_tokens=8,
        stop_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        temperature=0.7,
        value_head=model.value_head,
    )
    hook.remove()
    # the prefill: positions count only the prompt's real tokens; each step after it, one more
    real = prompt_mask.bool()
    assert torch.equal(seen[0][real], position_ids_from_mask(prompt_mask)[real])
    assert torch.equal(seen[1].squeeze(-1), position_ids_from_mask(prompt_mask)[:, -1] + 1)
    mask, _ = response_mask_from_ids(response, tokenizer.eos_token_id)

    seen.clear()
    hook = model.policy.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("position_ids")), with_kwargs=True
    )
    with torch.no_grad():
        scored = score_sequences(model, prompt_ids, prompt_mask, response, mask, temperature=0.7)
    hook.remove()
    attention = torch.cat([prompt_mask, mask.long()], 1)
    assert len(seen) == 1 and torch.equal(seen[0], position_ids_from_mask(attention))
    diff = torch.where(mask, (scored.logprobs - sampled).abs(), 0.0).max().item()
    assert diff < 1e-5
    assert scored.values.shape == response.shape and values is not None
    value_diff = torch.where(mask, (scored.values - values).abs(), 0.0).max().item()
    assert value_diff < 1e-5  # measured at most 3.3e-6 (GPT-2, values of about 4.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_response_positions_reach_the_lm_head_and_the_logits_are_exact(
    family_models, family
):
    model, tokenizer = load_quietly(family_models((family, "own", 0)))
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS)
    generator = torch.Generator().manual_seed(0)
    response_ids = torch.randint(4, len(tokenizer), (3, 7), generator=generator)
    response_mask = torch.arange(7).expand(3, 7) < torch.tensor([[5], [3], [4]])
    positions: list[int] = []  # how many positions the LM head computes logits for, per call
    hook = model.policy.get_output_embeddings().register_forward_hook(
        lambda module, args, output: positions.append(output.shape[1])
    )
    with torch.no_grad():
        fast = score_sequences(model, prompt_ids, prompt_mask, response_ids, response_mask)
        input_ids = torch.cat([prompt_ids, response_ids], 1)
        attention = torch.cat([prompt_mask, response_mask], 1).long()
        logits, _ = model(input_ids, attention)
    hook.remove()
    p = prompt_ids.shape[1]
    full = torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, response_ids[..., None])[..., 0]
    # the shortcut was taken: logits for the last T + 1 positions only, then for all P + T ...
    assert positions == [response_ids.shape[1] + 1, input_ids.shape[1]]
    diff = torch.where(response_mask, (fast.logprobs - full).abs(), 0.0).max().item()
    assert diff < 1e-5  # ... and changed nothing


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gpt2_activation_swap_leaves_other_families_as_loaded(family_models, family):
    from transformers import AutoModelForCausalLM
    from transformers.activations import GELUTanh

    folder = family_models((family, "own", 0))
    plain = AutoModelForCausalLM.from_pretrained(folder)
    loaded = load_causal_lm(folder)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in plain.modules()]
    assert GELUTanh not in {type(m) for m in loaded.modules()}


def test_a_tokenizer_without_a_pad_token_pads_with_eos_and_says_so(family_models):
    folder = family_models(("llama", "none", 0))
    with pytest.warns(PadTokenWarning, match=r"has no pad token: padding with its EOS token"):
        tokenizer = load_tokenizer(folder)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    assert tokenizer.padding_side == "left"


# Float32 round-off between micro-batches of 1 and 8 rows (another summation order), by case:
# each bound is about 20x the relative difference measured (in the comment); the mean-of-means
# bug gives differences of order 1.
EXACT_BOUND = {
    "llama-pad_own": 3e-5,  # 1.7e-6
    "qwen2-pad_own": 1e-4,  # 3.5e-6 (5.7e-6 with earlier builds' responses)
    "mistral-pad_own": 3e-5,  # 1.7e-6
    "gpt_neox-pad_own": 2e-5,  # 8.3e-7
    "qwen2-pad_eos-vocab_151936": 1e-4,  # 3.1e-6 (with the entropy bonus)
    "llama-pad_none": 3e-5,  # 1.9e-6
}


# GPT-2's own is tests/training/test_trainer.py::test_micro_batch_size_does_not_change_the_update.
@pytest.mark.parametrize("case", CASES[1:], ids=case_id)
def test_micro_batch_size_does_not_change_the_update(tmp_path, family_models, case, prompt_files):
    """One SGD iteration: micro_batch_size 1 and = mini_batch_size reach the same parameters."""
    folder = family_models(case)
    # A random model with 151936 rows draws a token its 512-token tokenizer knows about once in
    # 300: every response decodes to "", every score is equal, and only an entropy bonus moves
    # the weights.
    extra = ("ppo.entropy_coef=0.01",) if case[2] else ()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PadTokenWarning)
        results = parameters_after_one_sgd_iteration(tmp_path, folder, prompt_files, VARIED, *extra)
    from safetensors.torch import load_file

    base = load_file(str(folder / "model.safetensors"))
    moved = {k: v for k, v in results[8].items() if k in base}
    assert max_relative_difference(moved, base) > 1e-4
    assert max_relative_difference(results[1], results[8]) <= EXACT_BOUND[case_id(case)]


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_matches_an_uninterrupted_run(tmp_path, family_models, family, prompt_files):
    folder = family_models((family, "own", 0))
    train(small_config(tmp_path / "full", folder, prompt_files, "train.iterations=3", VARIED))
    part = tmp_path / "part"
    train(small_config(part, folder, prompt_files, "train.iterations=1", VARIED))
    summary = train(small_config(part, folder, prompt_files, "train.iterations=3", VARIED))
    assert summary.resumed_from == 1
    from safetensors.torch import load_file

    base = load_file(str(folder / "model.safetensors"))
    trained = parameters(part / "candidate")
    assert max_relative_difference({k: trained[k] for k in base}, base) > 1e-4  # it trained
    assert (
        max_relative_difference(
            parameters(part / "candidate"), parameters(tmp_path / "full" / "candidate")
        )
        == 0.0
    )


def test_a_reward_model_with_its_own_tokenizer_scores_the_decoded_text(
    tmp_path, tiny_model_dir, prompt_files
):
    """A Llama reward model whose vocabulary is not the GPT-2 policy's: it scores the decoded
    prompt and response, tokenized with its own tokenizer."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from ppo_core.base_sources.review_grammar import generate_review_corpus
    from ppo_core.base_sources.tiny_default import train_tokenizer
    from ppo_core.rewards.loading import build_reward_fn
    from tests.helpers import tiny_family_config

    reward_dir = tmp_path / "reward-model"
    tokenizer = train_tokenizer(generate_review_corpus(300, seed=7), vocab_size=300)
    policy_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.get_vocab() != policy_tokenizer.get_vocab()
    config = tiny_family_config("llama", len(tokenizer), tokenizer)
    config.num_labels = 1
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(reward_dir)
    tokenizer.save_pretrained(reward_dir)

    recorder = Recorder()
    train(
        small_config(
            tmp_path / "scored",
            tiny_model_dir,
            prompt_files,
            f"model.reward={reward_dir}",
            "train.iterations=1",
        ),
        loggers=[recorder],
    )
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
    reward = build_reward_fn(str(reward_dir))
    expected = reward(prompts, responses)
    # by hand: the reward model's own tokens of the decoded text, its last real token's score
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    for i in (0, 1):
        ids = tokenizer(prompts[i] + responses[i], return_tensors="pt").input_ids
        assert ids.max() < len(tokenizer)
        with torch.no_grad():
            by_hand = model(input_ids=ids).logits[0, 0].item()
        assert expected[i].item() == pytest.approx(by_hand, rel=1e-4, abs=1e-5)
    score = recorder.rows[0][1]["rollout/score"]
    assert math.isfinite(score)
    assert score == pytest.approx(expected.mean().item(), rel=1e-5, abs=1e-6)


def test_with_pad_equal_to_eos_the_first_eos_counts_and_is_rewarded(family_models):
    """Qwen2 ships pad = EOS: the EOS that ends a response is a real token (in the mask, and
    where the score lands); the same id after it is padding (out of the mask, no reward)."""
    from ppo_core.math.kl import token_rewards
    from ppo_core.models.generation import generate_responses

    model, tokenizer = load_quietly(family_models(("qwen2", "eos", 151936)))
    eos = tokenizer.eos_token_id
    assert tokenizer.pad_token_id == eos
    # An EOS bias on the LM head that gives EOS odds of about 1 in 3 at the first step, so that
    # responses end at different steps.
    prompt_ids, prompt_mask = encode_prompts(tokenizer, PROMPTS)
    with torch.no_grad():
        first = model.policy(input_ids=prompt_ids, attention_mask=prompt_mask).logits[:, -1]
    others = first.clone()
    others[:, eos] = -math.inf
    bias = (others.logsumexp(-1) - first[:, eos]).mean().item() + math.log(0.5)
    head = model.policy.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos] = bias
    model.policy.set_output_embeddings(biased)
    torch.manual_seed(0)
    batch = generate_responses(model.policy, tokenizer, PROMPTS * 4, max_new_tokens=10)
    lengths = batch.response_mask.sum(1)
    assert batch.has_eos.sum() >= 2 and len(set(lengths[batch.has_eos].tolist())) >= 2
    scores = torch.arange(1.0, 13.0)
    rewards = token_rewards(
        scores, torch.zeros_like(batch.response_mask, dtype=torch.float), batch.response_mask, 0.1
    )
    for row in range(12):
        n = int(lengths[row])
        ids, mask = batch.response_ids[row], batch.response_mask[row]
        if batch.has_eos[row]:
            assert ids[n - 1] == eos and (ids[: n - 1] != eos).all()  # the first EOS ends it ...
        assert mask[:n].all() and not mask[n:].any()  # ... and is the last token that counts
        assert (ids[n:] == eos).all()  # padding after it is the same id, outside the mask
        assert rewards[row, n - 1] == scores[row] and (rewards[row, n:] == 0).all()
