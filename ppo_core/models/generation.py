"""Batched sampling of responses with left-padded prompts and the KV cache (layer 2).

Responses are drawn from ``softmax(logits / temperature)``, cut only by the configured top-k and
top-p, so that the logprobs computed later describe the distribution that was actually sampled
(docs/design.md section 8). The rollout and evaluation sample with
:func:`generate_responses`, whose loop (:mod:`ppo_core.models.sampling`) reads no setting of
the model's own. For ``model.generate`` (benchmarks, serving checks), which fills every setting
left unset from the model's ``generation_config.json`` and then from transformers' defaults (a
top-k of 50 among them), :func:`sampling_config` sets each setting that shapes the distribution
and :func:`sample` runs it with the model's own generation settings out of the way.
transformers is imported where a generation config is built (its import takes seconds).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import Tensor

from ppo_core.models.folders import ModelFolderError
from ppo_core.prompts import Prompt, is_chat

__all__ = [
    "ChatTemplateError",
    "GeneratedBatch",
    "check_chat_template",
    "concat_generated",
    "decode_responses",
    "encode_prompts",
    "generate_responses",
    "prompt_token_ids",
    "render_chat",
    "require_chat_template",
    "response_mask_from_ids",
    "sample",
    "sampling_config",
    "stop_token_ids",
]


@dataclass
class GeneratedBatch:
    """Prompts and sampled responses, all on one device."""

    prompt_ids: Tensor  # [B, P] left-padded
    prompt_mask: Tensor  # [B, P] 1 on real prompt tokens
    response_ids: Tensor  # [B, T] padded after EOS
    response_mask: Tensor  # [B, T] True on real response tokens, the first EOS included
    has_eos: Tensor  # [B] whether the response ended with EOS before max_new_tokens
    logprobs: Tensor | None = None  # [B, T] each token's, under softmax(logits / temperature)
    values: Tensor | None = None  # [B, T] the value head's, of the state before each token


class ChatTemplateError(ModelFolderError):
    """Chat prompts meet a tokenizer that has no chat template to render them with, or a
    template that does not render a chat within :data:`CHAT_TEMPLATE_SECONDS` and
    :data:`MAX_RENDERED_CHARS`."""


CHAT_TEMPLATE_SECONDS = 5.0
"""Longest a chat template may take to render one chat. A template comes with the model (a GGUF
file's metadata, a hub snapshot): transformers' Jinja sandbox stops code, not loops, and two
nested ``range(100000)`` kept ``ppo validate`` busy for minutes."""

MAX_RENDERED_CHARS = 1 << 20
"""Most characters one rendered chat may hold (a prompt is a few thousand tokens at most)."""


def render_chat(tokenizer, messages: Sequence[dict], **options) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **options)``, within
    :data:`CHAT_TEMPLATE_SECONDS` (a SIGALRM timer, in the main thread when no other timer
    runs) and :data:`MAX_RENDERED_CHARS`; :class:`ChatTemplateError` past either."""
    with _time_limit(CHAT_TEMPLATE_SECONDS):
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, **options)
    if len(text) > MAX_RENDERED_CHARS:
        raise ChatTemplateError(
            f"the chat template rendered a chat of {len(text)} characters (at most "
            f"{MAX_RENDERED_CHARS}); the tokenizer's chat template is broken or hostile"
        )
    return text


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getitimer(signal.ITIMER_REAL)[0]
    ):
        yield  # a timer of someone else's, or no signals here: the size bound still holds
        return

    def stop(*_):
        raise ChatTemplateError(
            f"the chat template took longer than {seconds:g} s to render one chat "
            "(ppo_core.models.generation.CHAT_TEMPLATE_SECONDS); the tokenizer's chat "
            "template is broken or hostile"
        )

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_chat_template(
    tokenizer, prompts: Sequence[Prompt], folder: str | Path, role: str
) -> None:
    """Raise :class:`ChatTemplateError`, naming ``role`` and ``folder``, when ``prompts`` hold a
    chat and the tokenizer has no chat template."""
    if any(map(is_chat, prompts)):
        require_chat_template(tokenizer, folder, role)


def require_chat_template(tokenizer, folder: str | Path, role: str) -> None:
    """Raise :class:`ChatTemplateError`, naming ``role`` and ``folder``, when the tokenizer has
    no chat template to render chat prompts with."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError(
            f"{role} {str(folder)!r}: its tokenizer has no chat template, and the prompts are "
            "chat messages; use a model whose tokenizer_config.json (or chat_template.jinja) "
            "has one, or plain 'prompt' rows"
        )


def prompt_token_ids(tokenizer, prompts: Sequence[Prompt]) -> list[list[int]]:
    """The token ids the policy sees for each prompt, unpadded.

    A plain prompt is tokenised as text, with the tokenizer's own special tokens (a BOS, for
    Llama). A chat is rendered by the tokenizer's chat template with the generation prompt (the
    opening of the assistant's turn) and tokenised without adding special tokens: the template
    writes its own, and a second BOS would put the prompt off the distribution it was trained on.
    """
    ids: list[list[int]] = [[] for _ in prompts]
    plain = [i for i, prompt in enumerate(prompts) if not is_chat(prompt)]
    chats = [i for i, prompt in enumerate(prompts) if is_chat(prompt)]
    if plain:
        for i, row in zip(plain, tokenizer([prompts[i] for i in plain])["input_ids"], strict=True):
            ids[i] = list(row)
    if chats:
        texts = [
            render_chat(tokenizer, cast("list[dict]", prompts[i]), add_generation_prompt=True)
            for i in chats
        ]
        rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for i, row in zip(chats, rows, strict=True):
            ids[i] = list(row)
    return ids


def encode_prompts(
    tokenizer, prompts: Sequence[Prompt], device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Tokenise prompts (:func:`prompt_token_ids`), left-padded: ``(ids [B, P], mask [B, P])``."""
    tokenizer.padding_side = "left"
    rows = prompt_token_ids(tokenizer, prompts)
    width = max(map(len, rows), default=0)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def stop_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a response: the tokenizer's EOS and every id the model's own
    ``generation_config.json`` lists as ``eos_token_id`` (an int or a list).

    Chat models end an assistant turn with a token of their own (``<|im_end|>`` in Qwen2,
    ``<|eot_id|>`` in Llama 3) that their generation config lists beside the tokenizer's EOS;
    sampling sets the model's config aside (:func:`sample`), so the list is read here first.
    """
    ids = [tokenizer.eos_token_id]
    own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.extend([own] if isinstance(own, int) else list(own or ()))
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def response_mask_from_ids(
    response_ids: Tensor, eos_token_id: int | Sequence[int]
) -> tuple[Tensor, Tensor]:
    """Mask of real response tokens, from positions: everything up to and including the first
    stop token (``eos_token_id``: one id or several, :func:`stop_token_ids`).

    Works when the pad token equals EOS, since only the first EOS counts. ``[B, T] -> ([B, T],
    [B])``.
    """
    stops = torch.as_tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
        device=response_ids.device,
    )
    is_eos = torch.isin(response_ids, stops)
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
    stop_ids: Sequence[int] | None = None,
):
    """A ``GenerationConfig`` for plain sampling: every logits processor that ``generate`` could
    add is either the configured one or set to a value that leaves the distribution as it is
    (``top_k=0`` is no top-k; transformers would read an unset one as 50). Generation stops at
    any of ``stop_ids`` (default: the tokenizer's EOS)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=list(stop_ids) if stop_ids else tokenizer.eos_token_id,
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
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    device: torch.device | str = "cpu",
    few_row_layouts: bool = True,
    value_head: torch.nn.Module | None = None,
) -> GeneratedBatch:
    """Sample one response per prompt with the causal LM ``model`` (eval mode, KV cache), by
    :func:`ppo_core.models.sampling.sample_tokens`: the distribution ``generate`` would sample
    with :func:`sampling_config`, the model's own generation settings left out, and each
    token's log-probability kept (``few_row_layouts``: ``generation.few_row_layouts``); with
    ``value_head`` (on ``model``'s last hidden state) each state's value too."""
    from ppo_core.models.few_rows import few_row_products
    from ppo_core.models.sampling import sample_tokens

    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)
    stops = stop_token_ids(model, tokenizer)
    layouts = few_row_products(model) if few_row_layouts else contextlib.nullcontext()
    with layouts:
        sampled = sample_tokens(
            model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=max_new_tokens,
            stop_ids=stops,
            pad_token_id=tokenizer.pad_token_id,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            value_head=value_head,
        )
    response_mask, has_eos = response_mask_from_ids(sampled.response_ids, stops)
    return GeneratedBatch(
        prompt_ids,
        prompt_mask,
        sampled.response_ids,
        response_mask,
        has_eos,
        sampled.logprobs,
        sampled.values,
    )


def decode_responses(tokenizer, response_ids: Tensor, response_mask: Tensor) -> list[str]:
    """Text of each response up to (not including) EOS, special tokens removed (the end-of-turn
    tokens that chat models stop at, ``<|im_end|>`` or ``<|eot_id|>``, are special tokens)."""
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

    def right(x: Tensor, width: int, value: float | bool) -> Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    return GeneratedBatch(
        prompt_ids=torch.cat([left(b.prompt_ids, prompt_len, pad_token_id) for b in batches]),
        prompt_mask=torch.cat([left(b.prompt_mask, prompt_len, 0) for b in batches]),
        response_ids=torch.cat(
            [right(b.response_ids, response_len, pad_token_id) for b in batches]
        ),
        response_mask=torch.cat([right(b.response_mask, response_len, False) for b in batches]),
        has_eos=torch.cat([b.has_eos for b in batches]),
        logprobs=_joined([b.logprobs for b in batches], response_len),
        values=_joined([b.values for b in batches], response_len),
    )


def _joined(pieces: list[Tensor | None], width: int) -> Tensor | None:
    """Per-token ``[B_i, T_i]`` pieces padded with 0.0 to ``width`` and stacked; None when any
    piece is missing."""
    if any(piece is None for piece in pieces):
        return None
    whole = cast("list[Tensor]", pieces)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in whole])
