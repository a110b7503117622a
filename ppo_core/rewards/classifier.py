"""A sequence-classification reward model: built from a causal LM, fed, and read (layer 2).

A reward model is the policy's kind of transformer with a scalar head (``score``) in place of
the language-model head: Hugging Face's ``AutoModelForSequenceClassification`` with one label.
Its score of a text is the head applied to the last hidden state of the text's **last real
token**. Where that token is comes from the attention mask (:func:`ppo_core.math.pairwise.
last_token_index`), never from the pad id, because transformers' own models look for the pad
token: with the pad token equal to EOS (Llama, SmolLM2, Pythia ship without a pad token) a
text that ends with EOS, or a chat template's end-of-turn that is EOS, would be read one token
early. Positions come from the mask too (``cumsum(mask) - 1``), so left and right padding give
the same score (docs/design.md section 8, "Positions under left padding").
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ppo_core.math.pairwise import last_token_index
from ppo_core.models.causal_lm import (
    from_pretrained_checked,
    fuse_activations,
    position_ids_from_mask,
    unwrap_model,
)
from ppo_core.models.folders import ModelFolderError, check_model_folder
from ppo_core.models.generation import render_chat
from ppo_core.prompts import Prompt

__all__ = [
    "HEAD_NAME",
    "has_scalar_head",
    "load_reward_classifier",
    "new_reward_classifier",
    "padded",
    "scored_token_ids",
    "sequence_logits",
]

HEAD_NAME = "score"
"""The scalar head's module name in transformers' causal-LM sequence classifiers (GPT-2, Llama,
Qwen2, Mistral, GPT-NeoX, ...)."""


@contextlib.contextmanager
def _quiet_new_head() -> Iterator[None]:
    """Without transformers' notice that the head is newly initialised: here it always is."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*newly initialized.*")
            yield
    finally:
        hf_logging.set_verbosity(level)


def new_reward_classifier(
    base: str | Path, pad_token_id: int, trust_remote_code: bool = False, seed: int = 0
) -> Any:
    """A one-label sequence classifier with the trunk of the causal LM in ``base`` and a fresh
    scalar head (drawn from the model's own initialiser under ``seed``), in eval mode (dropout
    off: a pair's two passes must see the same network)."""
    from transformers import AutoModelForSequenceClassification

    folder = check_model_folder(base, "reward_model.base")
    with _quiet_new_head(), torch.random.fork_rng():
        torch.manual_seed(seed)
        model = from_pretrained_checked(
            AutoModelForSequenceClassification,
            folder,
            "reward_model.base",
            num_labels=1,
            trust_remote_code=trust_remote_code,
        )
    if not isinstance(getattr(model, HEAD_NAME, None), nn.Linear):
        raise ModelFolderError(
            f"reward_model.base={str(base)!r}: {type(model).__name__} has no linear {HEAD_NAME!r} "
            "head to read a score from; use a causal LM (GPT-2, Llama, Qwen2, Mistral, ...)"
        )
    model.config.pad_token_id = pad_token_id
    return fuse_activations(model).eval()


def load_reward_classifier(folder: str | Path, role: str, trust_remote_code: bool = False) -> Any:
    """A saved sequence-classification reward model, in eval mode."""
    from transformers import AutoModelForSequenceClassification

    path = check_model_folder(folder, role)
    model = from_pretrained_checked(
        AutoModelForSequenceClassification, path, role, trust_remote_code=trust_remote_code
    )
    return fuse_activations(model).eval()


def has_scalar_head(model: nn.Module) -> bool:
    """Whether :func:`sequence_logits` can read ``model`` itself (a ``score`` head on a trunk)."""
    inner = unwrap_model(model)
    prefix = getattr(inner, "base_model_prefix", None)
    return hasattr(inner, HEAD_NAME) and isinstance(prefix, str) and hasattr(inner, prefix)


def sequence_logits(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The head's output at each row's last real token. ``[B, L] -> [B, num_labels]`` float32.

    Runs the trunk (``model.<base_model_prefix>``, LoRA layers included when ``peft`` injected
    them) with positions from the mask, gathers the last real token's hidden state
    (:func:`last_token_index`), and applies the head to it alone."""
    inner: Any = unwrap_model(model)
    trunk = getattr(inner, inner.base_model_prefix)
    hidden = trunk(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    ).last_hidden_state
    last = last_token_index(attention_mask)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return getattr(inner, HEAD_NAME)(hidden[rows, last]).float()


def scored_token_ids(tokenizer: Any, prompt: Prompt, response: str) -> list[int]:
    """The reward model's own tokens of ``prompt + response``: plain text concatenated and
    tokenised as the tokenizer does (its BOS included); a chat rendered by the reward model's
    chat template with the response as the assistant's turn (tokenised without adding special
    tokens, the template writes them), or its turns' contents one a line without a template."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt + response)["input_ids"])
    turns = [*prompt, {"role": "assistant", "content": response}]
    if getattr(tokenizer, "chat_template", None) is not None:
        text = render_chat(tokenizer, turns)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(turn["content"] for turn in turns))["input_ids"])


def padded(
    rows: Sequence[Sequence[int]], pad_id: int, side: str = "right"
) -> tuple[Tensor, Tensor]:
    """``rows`` of token ids as ``input_ids`` and ``attention_mask`` ``[B, max length]``, padded
    on ``side`` (``right`` or ``left``) with ``pad_id``."""
    width = max(map(len, rows))
    ids, mask = [], []
    for row in rows:
        fill = width - len(row)
        pad, real = [pad_id] * fill, list(row)
        ids.append(real + pad if side == "right" else pad + real)
        mask.append([1] * len(row) + [0] * fill if side == "right" else [0] * fill + [1] * len(row))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
