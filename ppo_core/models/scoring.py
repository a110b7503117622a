"""The forward pass that scores responses (layer 2): the log-probabilities (and values, and
entropy) of the sampled response tokens under a policy, a reference or an actor-critic, with
positions taken from the attention mask so that left padding changes nothing."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ppo_core.math.losses import entropy_from_logits, logprobs_from_logits
from ppo_core.models.causal_lm import (
    logits_to_keep_kwargs,
    position_ids_from_mask,
    unwrap_model,
)
from ppo_core.models.policy import ActorCritic

__all__ = ["ScoredBatch", "score_sequences", "score_values"]


@dataclass
class ScoredBatch:
    """Logprobs (and values) of response tokens: each ``[B, T]``."""

    logprobs: Tensor
    values: Tensor | None
    entropy: Tensor | None


def score_sequences(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    with_values: bool = True,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> ScoredBatch:
    """One forward pass over ``[prompt; response]`` giving the response tokens' logprobs.

    Args:
        model: an :class:`ActorCritic` (values too) or a plain causal LM (logprobs only).
        prompt_ids, prompt_mask: ``[B, P]``, left-padded.
        response_ids, response_mask: ``[B, T]``; positions after EOS are masked.
        temperature: the sampling temperature, so the logprobs describe the sampled distribution.
        with_entropy: also return the per-token entropy ``[B, T]``; it carries a gradient only
            with ``entropy_grad`` (an entropy bonus in the loss).

    Returns:
        :class:`ScoredBatch` with ``[B, T]`` tensors aligned with ``response_ids``.
    """
    input_ids, attention_mask = _whole_sequences(
        prompt_ids, prompt_mask, response_ids, response_mask
    )
    prompt_len = prompt_ids.shape[1]
    length = response_ids.shape[1]
    # Logits at position t predict token t + 1, so the response needs those of the last
    # length + 1 positions but the final one; the LM head skips the prompt where the model allows.
    if isinstance(unwrap_model(model), ActorCritic):
        logits, values = model(input_ids, attention_mask, logits_to_keep=length + 1)
        values = values if with_values else None
    else:
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
            **logits_to_keep_kwargs(model, length + 1),
        ).logits
        values = None
    response_logits = logits[:, logits.shape[1] - length - 1 : -1]
    logprobs = logprobs_from_logits(response_logits, response_ids, temperature)
    entropy = None
    if with_entropy:
        # Entropy only enters the loss with an entropy bonus; as a metric it needs no graph.
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            entropy = entropy_from_logits(response_logits, temperature)
    if values is not None:
        values = _response_values(values, prompt_len, length)
    return ScoredBatch(logprobs=logprobs, values=values, entropy=entropy)


def score_values(
    model: ActorCritic,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
) -> Tensor:
    """The values alone of the states before each response token, ``[B, T]`` (float32 at
    least), by :meth:`ActorCritic.values`: for a rollout whose log-probabilities the sampler
    gave, so the pass skips what only they need (a separate critic's policy, the output
    layer)."""
    values = model.values(*_whole_sequences(prompt_ids, prompt_mask, response_ids, response_mask))
    return _response_values(values, prompt_ids.shape[1], response_ids.shape[1])


def _whole_sequences(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """``[prompt; response]``: ids and attention mask, ``[B, P + T]``."""
    return (
        torch.cat([prompt_ids, response_ids], dim=1),
        torch.cat([prompt_mask.long(), response_mask.long()], dim=1),
    )


def _response_values(values: Tensor, prompt_len: int, length: int) -> Tensor:
    """The values ``[B, P + T]`` of the states before each response token, ``[B, T]``, float32
    at least: the state before token ``t`` ends at position ``P - 1 + t``."""
    values = values[:, prompt_len - 1 : prompt_len - 1 + length]
    return values.to(torch.promote_types(values.dtype, torch.float32))
