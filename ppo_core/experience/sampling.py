"""Sampling and scoring responses (layer 3), for the PPO rollout and for evaluation alike.

:func:`sample_responses` samples one response per prompt in chunks, :func:`score_in_chunks`
recomputes their log-probabilities (and values) in length-ordered chunks, and
:func:`score_responses` decodes and rewards them. :func:`check_context_length` refuses, before
anything is sampled, a prompt and response budget past the model's positions.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from ppo_core.config import Config, ConfigError, GenerationConfig
from ppo_core.experience.engines import VLLMEngine
from ppo_core.files.artifacts import VALIDATION_RECORD
from ppo_core.math.batching import by_length, kept_columns, micro_batch_slices
from ppo_core.models.folders import check_model_folder, declared_positions
from ppo_core.models.generation import (
    GeneratedBatch,
    concat_generated,
    decode_responses,
    generate_responses,
    prompt_token_ids,
)
from ppo_core.models.policy import ActorCritic
from ppo_core.models.scoring import ScoredBatch, score_sequences, score_values
from ppo_core.parallel.runtime import Runtime
from ppo_core.prompts import Prompt, read_manifest_hash, read_validation_record
from ppo_core.rewards.loading import RewardFn, checked_scores

__all__ = [
    "POSITIVE_SCORE",
    "BoundAdoptedWarning",
    "check_context_length",
    "longest_prompt",
    "sample_responses",
    "score_in_chunks",
    "score_responses",
    "with_validated_settings",
]

POSITIVE_SCORE = 0.05
"""A response counts as positive above this score (the sentiment scorer's neutral band)."""


@torch.no_grad()
def sample_responses(
    policy: torch.nn.Module,
    tokenizer,
    prompts: Sequence[Prompt],
    generation: GenerationConfig,
    runtime: Runtime,
    chunk_size: int,
    chunk_seeds: Sequence[int] | None = None,
    engine: VLLMEngine | None = None,
    value_head: torch.nn.Module | None = None,
) -> GeneratedBatch:
    """One sampled response per prompt, ``chunk_size`` prompts per ``generate`` call.

    With ``chunk_seeds`` chunk ``i`` is sampled after ``torch.manual_seed(chunk_seeds[i])`` (one
    seed per chunk), so a chunk's responses do not depend on which process samples it; without
    them the global generator runs on from chunk to chunk. With an ``engine``
    (``generation.engine=vllm``) the engine samples them, given ``policy``'s weights first.
    With ``value_head`` (the loop only) the loop also gives each state's value.
    """
    if engine is not None:
        return engine.sample(policy, tokenizer, prompts, chunk_size, chunk_seeds, runtime.device)
    starts = range(0, len(prompts), chunk_size)
    if chunk_seeds is not None and len(chunk_seeds) != len(starts):
        raise ValueError(
            f"{len(prompts)} prompts in chunks of {chunk_size} need {len(starts)} "
            f"seeds, got {len(chunk_seeds)}"
        )
    pieces = []
    for index, start in enumerate(starts):
        if chunk_seeds is not None:
            torch.manual_seed(chunk_seeds[index])
        with runtime.autocast():
            pieces.append(
                generate_responses(
                    policy,
                    tokenizer,
                    prompts[start : start + chunk_size],
                    max_new_tokens=generation.max_new_tokens,
                    temperature=generation.temperature,
                    top_k=generation.top_k,
                    top_p=generation.top_p,
                    device=runtime.device,
                    few_row_layouts=generation.few_row_layouts,
                    value_head=value_head,
                )
            )
    return concat_generated(pieces, tokenizer.pad_token_id)


@torch.no_grad()
def score_in_chunks(
    model: torch.nn.Module,
    generated: GeneratedBatch,
    temperature: float,
    runtime: Runtime,
    chunk_size: int,
    with_values: bool,
    sampled_logprobs: Tensor | None = None,
) -> ScoredBatch:
    """Logprobs (and values) of every sampled response token, ``chunk_size`` rows per forward
    pass; ``[B, T]`` each, aligned with ``generated.response_ids`` (meaningful under its response
    mask only; 0.0 past the longest response of the row's chunk). With ``sampled_logprobs``
    (the sampler's, ``[B, T]``) those are the log-probabilities, and ``model``, an
    :class:`~ppo_core.models.policy.ActorCritic`, computes the values alone
    (:func:`~ppo_core.models.scoring.score_values`).

    Rows go through in order of length (:func:`~ppo_core.math.batching.by_length`), each chunk
    cut to its own longest prompt and response (:func:`~ppo_core.math.batching.kept_columns`),
    so a chunk of short responses costs what its tokens cost."""
    rows_total, width = generated.response_ids.shape
    device = generated.response_ids.device
    order = by_length(generated.prompt_mask, generated.response_mask)
    logprobs = torch.zeros((rows_total, width), dtype=torch.float32, device=device)
    values = torch.zeros_like(logprobs) if with_values else None
    for rows in micro_batch_slices(rows_total, chunk_size):
        index = order[rows]
        prompt_mask, response_mask = generated.prompt_mask[index], generated.response_mask[index]
        first, end = kept_columns(prompt_mask, response_mask)
        sequences = (
            generated.prompt_ids[index, first:],
            prompt_mask[:, first:],
            generated.response_ids[index, :end],
            response_mask[:, :end],
        )
        with runtime.autocast():
            if sampled_logprobs is not None and values is not None:
                values[index, :end] = score_values(cast("ActorCritic", model), *sequences).float()
                continue
            out = score_sequences(
                model, *sequences, temperature=temperature, with_values=with_values
            )
        logprobs[index, :end] = out.logprobs.float()
        if values is not None and out.values is not None:
            values[index, :end] = out.values.float()
    if sampled_logprobs is not None:
        logprobs = sampled_logprobs
    return ScoredBatch(logprobs=logprobs, values=values, entropy=None)


def score_responses(
    reward_fn: RewardFn,
    tokenizer,
    prompts: list[Prompt],
    generated: GeneratedBatch,
    references: Mapping[str, Sequence[Any]] | None = None,
) -> tuple[list[str], Tensor]:
    """Decode each response up to EOS and score it: ``(texts, scores [B] float32 on CPU)``,
    the rows' reference fields (``{field: [value per row]}``) given to the reward; a reward
    that returns the wrong shape or a non-finite number is a ``RewardError``."""
    texts = decode_responses(tokenizer, generated.response_ids, generated.response_mask)
    scores = reward_fn(prompts, texts, references) if references else reward_fn(prompts, texts)
    return texts, checked_scores(scores, len(prompts))


class BoundAdoptedWarning(UserWarning):
    """A stage took a setting its data was validated with (the prompt token bound, the
    reference fields) over its own."""


def with_validated_settings(config: Config, prompt_file: str | Path) -> Config:
    """``config`` with the settings ``ppo validate`` held ``prompt_file``'s data version to
    (its ``validated_with.json``): ``validation.max_tokens``, so that every stage sizes
    contexts for the prompts the data really holds, and ``data.reference_fields``, the fields
    its rows carry for the reward. Each setting that differs is named in a
    :class:`BoundAdoptedWarning`. A prompt file without a record, or whose record names another
    data version than its manifest, keeps the config's settings."""
    record = read_validation_record(prompt_file)
    if record is None or record.get("data_hash") != read_manifest_hash(prompt_file):
        return config  # none, or the record of another data version (a file copied by hand)
    where = f"{prompt_file}'s data version ({Path(prompt_file).with_name(VALIDATION_RECORD)})"
    validated = record["max_tokens"]
    if validated != config.validation.max_tokens:
        warnings.warn(
            f"validation.max_tokens={config.validation.max_tokens} differs from the "
            f"{validated} that `ppo validate` held {where} to; using {validated}",
            BoundAdoptedWarning,
            stacklevel=2,
        )
        config = replace(config, validation=replace(config.validation, max_tokens=validated))
    fields = record.get("reference_fields")  # absent from records written before it
    if isinstance(fields, list) and fields != list(config.data.reference_fields):
        warnings.warn(
            f"data.reference_fields={list(config.data.reference_fields)} differs from the "
            f"{fields} that `ppo validate` checked {where} for; using {fields}",
            BoundAdoptedWarning,
            stacklevel=2,
        )
        config = replace(config, data=replace(config.data, reference_fields=list(fields)))
    return config


def longest_prompt(tokenizer, prompts: Sequence[Prompt], config: Config, where: str) -> int:
    """The number of tokens of the longest of ``prompts`` as the policy sees them
    (:func:`~ppo_core.models.generation.prompt_token_ids`, a chat rendered by its template),
    refused past the model's positions with ``generation.max_new_tokens``
    (:func:`check_context_length`) or past ``validation.max_tokens``: a prompt ``ppo validate``
    did not hold to it (``where`` names the file) is an error before anything is sampled,
    never a row cut short."""
    lengths = [len(ids) for ids in prompt_token_ids(tokenizer, prompts)]
    longest = max(lengths, default=0)
    check_context_length(config, longest, where)
    bound = config.validation.max_tokens
    if longest > bound:
        row = lengths.index(longest)
        raise ConfigError(
            f"{where}: prompt {row} is {longest} tokens, more than validation.max_tokens="
            f"{bound}; validate the data with a bound that holds it (`ppo validate "
            f"validation.max_tokens={longest}`, which train and evaluate then adopt)"
        )
    return longest


def check_context_length(config: Config, longest: int, where: str) -> None:
    """Refuse, naming the key, a stage whose longest prompt (``longest`` tokens, of the file
    ``where``; measured, not the bound) plus ``generation.max_new_tokens`` does not fit the
    positions ``model.policy``'s ``config.json`` declares. Past them a learned position table
    fails mid-run with an ``IndexError``, and a rotary model samples where it was never
    trained, silently."""
    folder = check_model_folder(config.model.policy, "model.policy")
    found = declared_positions(folder)
    if found is None:
        return
    key, positions, path = found
    needed = longest + config.generation.max_new_tokens
    if needed > positions:
        raise ConfigError(
            f"the longest prompt of {where} ({longest} tokens) plus "
            f"generation.max_new_tokens={config.generation.max_new_tokens} is {needed} "
            f"positions, more than the {positions} model.policy has ({key} in {path}); lower "
            "generation.max_new_tokens or shorten the prompts"
        )
