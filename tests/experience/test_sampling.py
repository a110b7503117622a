"""The experience room on its own: sampling in seeded chunks, scoring in length-ordered chunks,
and the context-length check that runs before anything is sampled."""

from __future__ import annotations

import pytest
import torch

from ppo_core.config import ConfigError
from ppo_core.experience.sampling import (
    check_context_length,
    sample_responses,
    score_in_chunks,
)
from ppo_core.models.causal_lm import load_tokenizer
from ppo_core.models.policy import load_actor_critic
from ppo_core.models.scoring import score_sequences
from ppo_core.parallel.runtime import setup_runtime
from tests.helpers import small_config

PROMPTS = ["The movie was", "Honestly, I thought the acting", "This film", "A long, slow"]


@pytest.fixture(scope="module")
def sampler(tiny_model_dir, prompt_files, tmp_path_factory):
    config = small_config(tmp_path_factory.mktemp("experience"), tiny_model_dir, prompt_files)
    runtime = setup_runtime(config, distributed=False)
    return config, runtime, load_actor_critic(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_a_seeded_chunk_samples_the_same_responses_whatever_else_is_sampled(sampler):
    """With one seed a chunk, a chunk's responses do not depend on the chunks before it (the
    data-parallel rollout samples each chunk on whichever rank holds it)."""
    config, runtime, model, tokenizer = sampler
    both = sample_responses(
        model.policy, tokenizer, PROMPTS, config.generation, runtime, 2, chunk_seeds=[7, 8]
    )
    second = sample_responses(
        model.policy, tokenizer, PROMPTS[2:], config.generation, runtime, 2, chunk_seeds=[8]
    )
    width = second.response_ids.shape[1]
    assert torch.equal(both.response_ids[2:, :width], second.response_ids)
    assert torch.equal(both.response_mask[2:, :width], second.response_mask)


def test_a_seed_count_that_does_not_match_the_chunks_is_refused(sampler):
    config, runtime, model, tokenizer = sampler
    with pytest.raises(ValueError, match=r"4 prompts in chunks of 2 need 2 seeds, got 3"):
        sample_responses(
            model.policy, tokenizer, PROMPTS, config.generation, runtime, 2, chunk_seeds=[1, 2, 3]
        )


def test_scoring_in_length_ordered_chunks_gives_the_logprobs_of_one_plain_pass(sampler):
    """Rows go through shortest first, in chunks cut to their own longest prompt and response,
    and land back in their own rows: the same log-probabilities and values as one pass over the
    batch as sampled, up to round-off (measured: below 1e-6 on the tiny default)."""
    config, runtime, model, tokenizer = sampler
    torch.manual_seed(0)
    generated = sample_responses(model.policy, tokenizer, PROMPTS, config.generation, runtime, 4)
    with torch.no_grad():
        plain = score_sequences(
            model,
            generated.prompt_ids,
            generated.prompt_mask,
            generated.response_ids,
            generated.response_mask,
            temperature=1.0,
            with_values=True,
        )
    mask = generated.response_mask
    assert mask.any()
    for chunk_size in (1, 3, 4):
        chunked = score_in_chunks(model, generated, 1.0, runtime, chunk_size, with_values=True)
        assert torch.where(mask, chunked.logprobs - plain.logprobs, 0.0).abs().max() < 1e-5
        assert chunked.values is not None and plain.values is not None
        assert torch.where(mask, chunked.values - plain.values, 0.0).abs().max() < 1e-5


def test_the_context_length_check_names_the_key_and_the_models_positions(
    tmp_path, tiny_model_dir, prompt_files
):
    """The longest prompt as measured (not the validation bound) plus the new tokens against
    the tiny default's 64 positions."""
    fits = small_config(tmp_path, tiny_model_dir, prompt_files, "generation.max_new_tokens=32")
    check_context_length(fits, 32, "train.jsonl")  # 32 + 32 = the tiny default's 64 positions
    too_long = small_config(tmp_path, tiny_model_dir, prompt_files, "generation.max_new_tokens=33")
    with pytest.raises(
        ConfigError,
        match=r"the longest prompt of train.jsonl \(32 tokens\) plus generation.max_new_tokens=33 "
        r"is 65 positions, more than the 64 model.policy has \(n_positions",
    ):
        check_context_length(too_long, 32, "train.jsonl")
