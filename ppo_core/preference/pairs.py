"""A prepared preference version read back, and its pairs as the reward model's tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_core.feedback.rows import PreferencePair
from ppo_core.files.artifacts import DATA_MANIFEST
from ppo_core.prompts import Prompt, PromptFileError, parse_messages

__all__ = ["FEEDBACK_FOLDER", "TokenisedPair", "read_pair_split", "read_pair_version", "tokenise"]

FEEDBACK_FOLDER = "feedback"
"""The pair version's folder inside ``data.interim_dir`` and ``data.prepared_dir``."""
PAIR_COLUMNS = ("prompt", "chosen", "rejected", "id", "source")


@dataclass(frozen=True)
class TokenisedPair:
    """One pair as the reward model reads it: its two texts' token ids (prompt + reply)."""

    chosen_ids: list[int]
    rejected_ids: list[int]


def read_pair_version(folder: str | Path) -> dict[str, Any]:
    """The manifest of the pair version in ``folder`` (``manifest.json``), or a
    :class:`PromptFileError` naming what is missing."""
    path = Path(folder) / DATA_MANIFEST
    if not path.is_file():
        raise PromptFileError(f"{path} is missing; run `ppo prepare` and `ppo validate` first")
    manifest = json.loads(path.read_text())
    if not isinstance(manifest, dict) or not isinstance(manifest.get("counts"), dict):
        raise PromptFileError(f"{path} is not a pair version's manifest; run `ppo prepare` again")
    return manifest


def read_pair_split(folder: str | Path, split: str, chat: bool) -> list[PreferencePair]:
    """The pairs of ``split`` (``train`` or ``eval``) in the version ``folder``; a chat
    version's prompts are the canonical JSON of their turns, parsed back here."""
    import pandas as pd

    path = Path(folder) / f"{split}.parquet"
    frame = pd.read_parquet(path, columns=[c for c in PAIR_COLUMNS])
    pairs = []
    for number, row in enumerate(frame.itertuples(index=False), start=1):
        prompt: Prompt = (
            parse_messages(row.prompt, f"{path} row {number}: prompt") if chat else row.prompt
        )
        pairs.append(
            PreferencePair(
                prompt=prompt,
                chosen=row.chosen,
                rejected=row.rejected,
                id=row.id if isinstance(row.id, str) else None,
                source=row.source if isinstance(row.source, str) else None,
            )
        )
    return pairs


def tokenise(tokenizer: Any, pairs: list[PreferencePair], max_length: int) -> list[TokenisedPair]:
    """Each pair's chosen and rejected text as the reward model's tokens, cut to
    ``max_length`` (the model's positions): the score is read at the last token kept."""
    from ppo_core.rewards.classifier import scored_token_ids  # torch: only where pairs are read

    return [
        TokenisedPair(
            scored_token_ids(tokenizer, pair.prompt, pair.chosen)[:max_length],
            scored_token_ids(tokenizer, pair.prompt, pair.rejected)[:max_length],
        )
        for pair in pairs
    ]
