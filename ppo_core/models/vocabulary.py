"""Whether token ids mean the same text under two models (layer 2, model I/O).

KL between two policies, and any comparison of their token-level numbers, is only defined when
both map ids to the same text: the same vocabulary and the same special-token ids.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_core.files import first_line
from ppo_core.models.folders import ModelFolderError, check_model_folder

__all__ = [
    "SPECIAL_TOKENS",
    "TOKENIZER_FILES",
    "Vocabulary",
    "reference_vocabulary",
    "vocabulary_mismatch",
    "vocabulary_of",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SPECIAL_TOKENS = ("bos", "eos", "unk")
"""Special tokens whose ids must agree for KL. Pad is left out: padded positions are masked out of
every score, so a reference folder that names another pad token still measures the same KL."""


@dataclass(frozen=True)
class Vocabulary:
    """What decides whether token ids mean the same text under two models."""

    folder: str
    digest: str
    """SHA-256 of the tokenizer's token -> id mapping (added tokens included)."""
    size: int
    special_ids: dict[str, int | None]
    model_type: str | None
    model_vocab_size: int | None
    """``vocab_size`` of the model's config: the rows of its embedding and output layer."""

    def describe(self) -> str:
        return f"{self.folder} ({self.model_type or 'unknown model type'}, {self.size} tokens)"


def vocabulary_of(folder: str | Path, tokenizer: Any) -> Vocabulary:
    """The vocabulary of ``tokenizer`` together with the model config in ``folder``."""
    mapping = tokenizer.get_vocab()
    digest = hashlib.sha256(
        json.dumps(sorted(mapping.items()), ensure_ascii=False).encode()
    ).hexdigest()
    config_file = Path(folder) / "config.json"
    adapter_base = Path(folder) / "adapter_base.json"
    try:
        if not config_file.is_file() and adapter_base.is_file():  # a LoRA adapter: its base's
            config_file = Path(json.loads(adapter_base.read_text())["base"]) / "config.json"
        model_config = json.loads(config_file.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        model_config = {}
    if not isinstance(model_config, dict):
        model_config = {}
    # Multimodal configs keep the language model's vocabulary under text_config.
    text_config = model_config.get("text_config")
    vocab_size = model_config.get("vocab_size")
    if vocab_size is None and isinstance(text_config, dict):
        vocab_size = text_config.get("vocab_size")
    return Vocabulary(
        folder=str(folder),
        digest=digest,
        size=len(mapping),
        special_ids={name: getattr(tokenizer, f"{name}_token_id", None) for name in SPECIAL_TOKENS},
        model_type=model_config.get("model_type"),
        model_vocab_size=vocab_size if isinstance(vocab_size, int) else None,
    )


def vocabulary_mismatch(a: Vocabulary, b: Vocabulary) -> str | None:
    """Why token ids sampled under ``a`` do not mean the same to ``b``, or None when they do.

    The model types may differ (two architectures can share a tokenizer); the vocabularies, the
    BOS/EOS/UNK ids and the models' embedding sizes may not.
    """
    if a.digest != b.digest:
        return f"their vocabularies differ ({a.size} and {b.size} tokens)"
    reasons = [
        f"{name} token id {a.special_ids[name]} and {b.special_ids[name]}"
        for name in SPECIAL_TOKENS
        if a.special_ids[name] != b.special_ids[name]
    ]
    sizes = (a.model_vocab_size, b.model_vocab_size)
    if None not in sizes and sizes[0] != sizes[1]:
        reasons.append(f"model vocab_size {a.model_vocab_size} and {b.model_vocab_size}")
    return "; ".join(reasons) or None


def reference_vocabulary(
    policy: str | Path, reference: str | Path | None, trust_remote_code: bool = False
) -> Vocabulary:
    """The KL reference's vocabulary (``reference``, else ``policy``): its own tokenizer, or the
    policy's when its folder holds none (training samples with the policy's tokenizer and scores
    with the reference)."""
    from transformers import AutoTokenizer

    folder = check_model_folder(reference or policy, "reference")
    has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
    tokenizer_folder = folder if has_tokenizer else check_model_folder(policy, "tokenizer")
    # Not load_tokenizer: a reference is never sampled from, so it needs no pad token.
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_folder, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFolderError(
            f"cannot load the KL reference's tokenizer from {str(tokenizer_folder)!r}: "
            + first_line(exc)
        ) from None
    return vocabulary_of(folder, tokenizer)
