"""Batched sampling of responses with left-padded prompts and the KV cache (layer 2).

Responses are drawn from ``softmax(logits / temperature)``, cut only by the configured top-k and
top-p, so that the logprobs computed later describe the distribution that was actually sampled
(docs/design.md section 8). ``generate`` fills every setting left unset from the model's own
``generation_config.json`` and then from transformers' defaults (a top-k of 50 among them), so
:func:`sampling_config` sets each setting that shapes the distribution, and :func:`sample` runs
``generate`` with the model's own generation settings out of the way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "GeneratedBatch",
    "concat_generated",
    "decode_responses",
    "encode_prompts",
    "generate_responses",
    "response_mask_from_ids",
    "sample",
    "sampling_config",
]


@dataclass
class GeneratedBatch:
    """Prompts and sampled responses, all on one device."""

    prompt_ids: Tensor  # [B, P] left-padded
    prompt_mask: Tensor  # [B, P] 1 on real prompt tokens
    response_ids: Tensor  # [B, T] padded after EOS
    response_mask: Tensor  # [B, T] True on real response tokens, the first EOS included
    has_eos: Tensor  # [B] whether the response ended with EOS before max_new_tokens


def encode_prompts(
    tokenizer, prompts: list[str], device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Tokenise prompts, left-padded: ``(ids [B, P], mask [B, P])``."""
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, padding=True, return_tensors="pt")
    return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)


def response_mask_from_ids(response_ids: Tensor, eos_token_id: int) -> tuple[Tensor, Tensor]:
    """Mask of real response tokens, from positions: everything up to and including the first EOS.

    Works when the pad token equals EOS, since only the first EOS counts. ``[B, T] -> ([B, T],
    [B])``.
    """
    is_eos = response_ids == eos_token_id
    has_eos = is_eos.any(dim=1)
    length = response_ids.shape[1]
    positions = torch.arange(length, device=response_ids.device).expand_as(response_ids)
    first_eos = torch.where(is_eos, positions, length).amin(dim=1)
    mask = positions <= first_eos.unsqueeze(1)
    return mask, has_eos


def sampling_config(
    tokenizer,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """A ``GenerationConfig`` for plain sampling: every logits processor that ``generate`` could
    add is either the configured one or set to a value that leaves the distribution as it is
    (``top_k=0`` is no top-k; transformers would read an unset one as 50)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
        num_beams=1,
        repetition_penalty=1.0,
        typical_p=1.0,
        min_p=0.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        exponential_decay_length_penalty=None,
        renormalize_logits=False,
    )


@contextmanager
def _without_model_generation_settings(model) -> Iterator[None]:
    """The model's ``generation_config`` replaced by an empty one for the ``with`` block, so that
    none of its settings (a checkpoint's ``suppress_tokens``, ``bad_words_ids``, ``top_k``, ...)
    fills a gap in the sampling config; put back afterwards, so a saved model keeps its own."""
    from transformers import GenerationConfig

    own = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = own


@torch.no_grad()
def sample(model, prompt_ids: Tensor, prompt_mask: Tensor, config, **outputs):
    """``model.generate`` with ``config`` (from :func:`sampling_config`) and nothing of the
    model's own generation settings; ``outputs`` asks for more (``output_logits=True``, ...)."""
    with _without_model_generation_settings(model):
        return model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, **outputs
        )


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    device: torch.device | str = "cpu",
) -> GeneratedBatch:
    """Sample one response per prompt with the causal LM ``model`` (eval mode, KV cache)."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)
    config = sampling_config(tokenizer, max_new_tokens, temperature, top_k, top_p)
    output = sample(model, prompt_ids, prompt_mask, config)
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    response_ids = output[:, prompt_ids.shape[1] :]
    response_mask, has_eos = response_mask_from_ids(response_ids, eos_id)
    response_ids = torch.where(response_mask, response_ids, pad_id)
    return GeneratedBatch(prompt_ids, prompt_mask, response_ids, response_mask, has_eos)


def decode_responses(tokenizer, response_ids: Tensor, response_mask: Tensor) -> list[str]:
    """Text of each response up to (not including) EOS, special tokens removed."""
    texts = []
    for ids, mask in zip(response_ids.tolist(), response_mask.tolist(), strict=True):
        kept = [
            t for t, keep in zip(ids, mask, strict=True) if keep and t != tokenizer.eos_token_id
        ]
        texts.append(tokenizer.decode(kept, skip_special_tokens=True))
    return texts


def concat_generated(batches: list[GeneratedBatch], pad_token_id: int) -> GeneratedBatch:
    """Join batches sampled separately: prompts re-padded on the left, responses on the right."""
    if len(batches) == 1:
        return batches[0]
    prompt_len = max(b.prompt_ids.shape[1] for b in batches)
    response_len = max(b.response_ids.shape[1] for b in batches)

    def left(x: Tensor, width: int, value: int) -> Tensor:
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

    def right(x: Tensor, width: int, value: int | bool) -> Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    return GeneratedBatch(
        prompt_ids=torch.cat([left(b.prompt_ids, prompt_len, pad_token_id) for b in batches]),
        prompt_mask=torch.cat([left(b.prompt_mask, prompt_len, 0) for b in batches]),
        response_ids=torch.cat(
            [right(b.response_ids, response_len, pad_token_id) for b in batches]
        ),
        response_mask=torch.cat([right(b.response_mask, response_len, False) for b in batches]),
        has_eos=torch.cat([b.has_eos for b in batches]),
    )
