"""The sampling loop (layer 2): responses drawn token by token with a KV cache, rows set aside
as they end, and each sampled token's log-probability kept.

``model.generate`` would do the drawing, but on the rollout's shapes it spends a third of its
time on work PPO does not need (docs/design.md section 8, docs/benchmarks.md "Where a SmolLM2
iteration's time goes"): every row runs until the longest one ends, the KV cache grows by
concatenation (each step copies all of it), and ``torch.multinomial`` draws one exponential
number per vocabulary entry. Here

- the cache is allocated once for the longest possible response and written in place
  (:func:`preallocated_cache`);
- rows that have ended are dropped from the batch (and the cache) once they are a quarter of
  the rows still running, so a finished row costs at most a few steps;
- a token is drawn by inverting the cumulative distribution with one uniform number per row
  and step, ``torch.rand(B)`` for every row of the batch, ended or not: a row's draws do not
  depend on when the other rows end, nor on when they were dropped;
- the log-probability of each sampled token under ``softmax(logits / temperature)`` (before
  top-k and top-p, as the scoring pass computes it) comes out with the tokens, so the rollout
  can take the old log-probabilities from sampling (``ppo.old_logprobs``);
- given the policy's value head, the value of the state before each sampled token comes out
  too: the head applied to the hidden state the output layer reads at that position (captured
  by a pre-hook on it), the state the scoring pass gives the head. With both, a rollout on a
  shared critic needs no scoring pass of the policy at all.

The distribution is the one ``generate`` samples with the same settings: ``logits /
temperature``, then transformers' own top-k and top-p warpers, then the softmax.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn

from ppo_core.math.losses import logprobs_from_logits
from ppo_core.models.causal_lm import (
    logits_to_keep_kwargs,
    position_ids_from_mask,
    unwrap_model,
)

__all__ = [
    "KVCacheTooLargeError",
    "NonFiniteSamplingError",
    "Sampled",
    "draw_from",
    "kv_cache_bytes",
    "preallocated_cache",
    "sample_tokens",
]


class KVCacheTooLargeError(MemoryError):
    """The KV cache a sampling call would allocate up front does not fit the memory free on its
    device: refused before anything is allocated, naming its size and the keys that set it."""


class NonFiniteSamplingError(FloatingPointError):
    """A step's distribution held a NaN or an infinite probability: sampling stops there, since
    the draw would return some token (the last of the vocabulary) as if it had been sampled."""


class Sampled(NamedTuple):
    """What :func:`sample_tokens` returns, each ``[B, T]``, ``T`` the longest response."""

    response_ids: Tensor
    """The tokens, with the pad id after a row's end."""
    logprobs: Tensor
    """Each token's log-probability under ``softmax(logits / temperature)``; 0.0 after the end,
    float32."""
    values: Tensor | None
    """With a value head, the value of the state before each token (0.0 after the end,
    float32); else None."""


COMPACT_FRACTION = 0.25
"""Ended rows are dropped once they are at least this share of the rows still computed: each
drop copies the cache, so dropping at every end would cost what concatenation costs."""


def _cache_classes():
    # transformers' import takes seconds; the classes are built the first time they are needed.
    from transformers.cache_utils import Cache, DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """One layer's keys and values, ``[B, heads, max_length, head_dim]`` allocated at the
        first update and written in place; ``keys``/``values`` are views of the filled part."""

        def __init__(self, max_length: int) -> None:
            super().__init__()
            self.max_length = max_length
            self.length = 0

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            batch, heads, _, key_dim = key_states.shape
            self.device = key_states.device
            self.key_buffer = key_states.new_empty(batch, heads, self.max_length, key_dim)
            self.value_buffer = value_states.new_empty(
                batch, value_states.shape[1], self.max_length, value_states.shape[-1]
            )
            self.is_initialized = True

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self.max_length:
                raise RuntimeError(
                    f"the KV cache holds {self.max_length} positions; {end} were asked for"
                )
            self.key_buffer[:, :, self.length : end] = key_states
            self.value_buffer[:, :, self.length : end] = value_states
            self.length = end
            self._views()
            return self.keys, self.values

        def _views(self) -> None:
            self.keys = self.key_buffer[:, :, : self.length]
            self.values = self.value_buffer[:, :, : self.length]

        def get_seq_length(self) -> int:
            return self.length

        def batch_select_indices(self, indices: Tensor) -> None:
            if self.is_initialized:
                self.key_buffer = self.key_buffer[indices]
                self.value_buffer = self.value_buffer[indices]
                self._views()

    class Preallocated(Cache):
        """A cache of :class:`PreallocatedLayer` s, one per decoder layer."""

        def __init__(self, num_layers: int, max_length: int) -> None:
            super().__init__(layers=[PreallocatedLayer(max_length) for _ in range(num_layers)])

        def keep_rows(self, indices: Tensor) -> None:
            for layer in self.layers:
                cast("PreallocatedLayer", layer).batch_select_indices(indices)

    return Preallocated


_PREALLOCATED = None


def preallocated_cache(num_layers: int, max_length: int):
    """A transformers ``Cache`` of ``num_layers`` layers that holds up to ``max_length``
    positions per row, written in place; ``keep_rows(indices)`` drops the other rows."""
    global _PREALLOCATED
    if _PREALLOCATED is None:
        _PREALLOCATED = _cache_classes()
    return _PREALLOCATED(num_layers, max_length)


def _warpers(temperature: float, top_k: int, top_p: float):
    """transformers' own top-k and top-p warpers for these settings (none when they leave the
    distribution whole), applied after the temperature as ``generate`` applies them."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    warpers: list[Callable[[Any, Tensor], Tensor]] = []
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    return warpers


def draw_from(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row of ``probs`` ``[B, V]`` (rows need not sum to one), by inverting the
    cumulative distribution at ``uniforms`` ``[B]`` in ``[0, 1)``: token ``v`` is drawn when the
    uniform falls in ``[cdf(v - 1), cdf(v))``, so a token of probability zero never is. The sum
    runs in float64, so its rounding (about 1e-16 of the total) shifts no token's chance
    measurably."""
    cdf = probs.double().cumsum(dim=-1)
    targets = uniforms.double().unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _cache_keyword(model: nn.Module) -> str:
    # transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns until 5.40).
    forward = type(unwrap_model(model)).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def kv_cache_bytes(model: nn.Module, rows: int, length: int, element_size: int) -> int:
    """Bytes of a KV cache of ``rows`` x ``length`` positions for every decoder layer of
    ``model``: keys and values, ``num_key_value_heads x head_dim`` each per position."""
    config: Any = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * _num_layers(model) * rows * length * kv_heads * head_dim * element_size


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device``: CUDA's free memory, else the machine's
    ``MemAvailable`` (None where neither is known)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_cache_fits(model: nn.Module, rows: int, length: int, device: torch.device) -> None:
    dtype = next(model.parameters()).dtype
    needed = kv_cache_bytes(model, rows, length, torch.finfo(dtype).bits // 8)
    free = free_memory_bytes(device)
    if free is not None and needed > free:
        raise KVCacheTooLargeError(
            f"sampling {rows} rows of up to {length} positions ({_num_layers(model)} layers) "
            f"needs a KV cache of {needed / 2**30:.1f} GiB, and {device.type} has "
            f"{free / 2**30:.1f} GiB free: lower ppo.generation_batch_size (the rollout; the "
            "evaluation samples ppo.rollout_batch_size rows at once) or generation.max_new_tokens"
        )


def _num_layers(model: nn.Module) -> int:
    config: Any = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return int(config.num_hidden_layers)


@torch.no_grad()
def sample_tokens(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    value_head: nn.Module | None = None,
) -> Sampled:
    """Sample up to ``max_new_tokens`` tokens after each left-padded prompt.

    Args:
        model: a causal LM whose ``forward`` takes a transformers ``Cache`` (every model in
            transformers does); eval mode.
        prompt_ids, prompt_mask: ``[B, P]``, left-padded.
        stop_ids: a row ends at the first of these (included in its response).
        value_head: ``[H] -> [1]``, the head on ``model``'s last hidden state
            (:class:`~ppo_core.models.policy.ActorCritic`'s shared one): values come out too.

    Returns:
        :class:`Sampled`: tokens, their log-probabilities, and values with ``value_head``.
    """
    batch, prompt_length = prompt_ids.shape
    _check_cache_fits(model, batch, prompt_length + max_new_tokens, prompt_ids.device)
    cache = preallocated_cache(_num_layers(model), prompt_length + max_new_tokens)
    attention = prompt_mask.long()
    positions = position_ids_from_mask(attention)
    with _CachedForward(model, cache, value_head) as forward:
        first = forward(prompt_ids, attention, positions, **logits_to_keep_kwargs(model, 1))
        return _draw_responses(
            forward,
            first,
            attention,
            positions[:, -1] + 1,
            max_new_tokens=max_new_tokens,
            stops=torch.as_tensor(list(stop_ids), device=prompt_ids.device),
            pad_token_id=pad_token_id,
            temperature=temperature,
            warpers=_warpers(temperature, top_k, top_p),
        )


class _CachedForward(contextlib.AbstractContextManager):
    """One step of the model on the cache: ``(logits of the last position [B, V], the values
    there [B] or None)``. With a value head, a pre-hook on the output layer keeps the hidden
    state it reads (only the kept positions: one a row), so nothing of the trunk runs twice."""

    def __init__(self, model: nn.Module, cache, value_head: nn.Module | None) -> None:
        self.model, self.cache, self.value_head = model, cache, value_head
        self.cache_kwargs = {_cache_keyword(model): cache, "use_cache": True}
        self.hidden: Tensor | None = None
        self.hook = None
        if value_head is not None:
            self.head_dtype = next(value_head.parameters()).dtype
            output_layer = cast("Any", unwrap_model(model)).get_output_embeddings()
            if not isinstance(output_layer, nn.Module):
                raise ValueError(
                    f"{type(unwrap_model(model)).__name__} has no output layer to read its "
                    "last hidden state at"
                )
            self.hook = output_layer.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.hidden = args[0] if args else next(iter(kwargs.values()))

    def __call__(
        self, input_ids: Tensor, attention: Tensor, positions: Tensor, **kwargs
    ) -> tuple[Tensor, Tensor | None]:
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            **self.cache_kwargs,
            **kwargs,
        ).logits[:, -1]
        if self.value_head is None or self.hidden is None:
            return logits, None
        values = self.value_head(self.hidden[:, -1].to(self.head_dtype))[..., 0].float()
        self.hidden = None
        return logits, values

    def __exit__(self, *exc) -> None:
        if self.hook is not None:
            self.hook.remove()


def _draw_responses(
    forward: _CachedForward,
    first: tuple[Tensor, Tensor | None],
    attention: Tensor,
    next_position: Tensor,
    *,
    max_new_tokens: int,
    stops: Tensor,
    pad_token_id: int,
    temperature: float,
    warpers: list,
) -> Sampled:
    """The loop of :func:`sample_tokens` from the prompts' step ``first``: a token a step for
    every unended row, ended rows dropped from the batch and the cache by
    :data:`COMPACT_FRACTION`."""
    logits, value = first
    batch, device = len(logits), logits.device
    tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    values = None if value is None else torch.zeros_like(logprobs)
    rows = torch.arange(batch, device=device)  # the batch row of each row still computed
    running = torch.ones(batch, dtype=torch.bool, device=device)  # of those, the unended
    steps = 0
    for step in range(max_new_tokens):
        uniforms = torch.rand(batch, device=device)[rows]
        token, token_logprob = _draw_next(logits, uniforms, temperature, warpers, step=step)
        live = rows[running]
        tokens[live, step] = token[running]
        logprobs[live, step] = token_logprob[running]
        if values is not None and value is not None:
            values[live, step] = value[running]
        steps = step + 1
        running &= ~torch.isin(token, stops)
        ended = int((~running).sum())
        if ended == len(rows) or steps == max_new_tokens:
            break
        if ended >= COMPACT_FRACTION * len(rows):
            keep = running.nonzero().squeeze(-1)
            forward.cache.keep_rows(keep)
            rows, token, attention = rows[keep], token[keep], attention[keep]
            next_position, running = next_position[keep], running[keep]
        attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=1)
        logits, value = forward(token.unsqueeze(-1), attention, next_position.unsqueeze(-1))
        next_position = next_position + 1
    return Sampled(
        tokens[:, :steps], logprobs[:, :steps], None if values is None else values[:, :steps]
    )


def _draw_next(
    logits: Tensor, uniforms: Tensor, temperature: float, warpers: list, *, step: int = 0
) -> tuple[Tensor, Tensor]:
    """A token for each row of ``logits`` ``[B, V]`` and its log-probability under
    ``softmax(logits / temperature)``, computed as the scoring pass computes it. A NaN or
    infinite probability is :class:`NonFiniteSamplingError` naming the response token ``step``
    and the temperature, never a drawn token."""
    logits = logits.float()
    scaled = logits / temperature if temperature != 1.0 else logits
    for warp in warpers:
        scaled = warp(None, scaled)
    probs = torch.softmax(scaled, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise NonFiniteSamplingError(_non_finite(logits, step, temperature))
    token = draw_from(probs, uniforms)
    token_logprob = logprobs_from_logits(
        logits.unsqueeze(1), token.unsqueeze(1), temperature
    ).squeeze(1)
    return token, token_logprob


def _non_finite(logits: Tensor, step: int, temperature: float) -> str:
    """Why step ``step``'s probabilities are not finite: the model's own logits, or the
    temperature that scaled them past float32."""
    where = f"sampling response token {step + 1}: the next-token probabilities hold NaN or inf"
    if not bool(torch.isfinite(logits).all()):
        return f"{where}, since the model's logits do (its weights or inputs, not a setting)"
    return (
        f"{where}: generation.temperature={temperature:g} scales logits of up to "
        f"{float(logits.abs().max()):.3g} past float32 (logits / temperature overflows); "
        "raise it"
    )
