"""The feedback beside the prompts: ``ppo prepare`` makes a pair version of
``data.feedback_dir``, ``ppo validate`` checks it with Great Expectations and publishes it with
the prompts (docs/design.md section 3, "Feedback").

A pair version is ``feedback/`` inside ``data.interim_dir`` (then ``data.prepared_dir``):
``train.parquet`` and ``eval.parquet`` with the columns ``prompt`` (plain text, or a chat as the
canonical JSON of its turns), ``chosen``, ``rejected``, ``id``, ``source``, and
``manifest.json`` (content hash, counts, source files with their SHA-256). It is written even
when there is no feedback (``pairs`` 0, no splits), so that ``ppo reward`` always finds a
version to read and says there is nothing to learn.

The rows: pair rows as they are; rating rows made into pairs by the rule of
:func:`ppo_core.feedback.rows.pairs_from_ratings` (every liked reply against every disliked reply to
the same prompt), counted in the manifest. Prompts are normalised as prompt files' are, replies
stripped of leading and trailing whitespace; a pair whose prompt is empty is dropped, as are
repeated pairs (same prompt, chosen and rejected; the first wins). The split hashes the
prompt with ``data.split_seed``, so every pair of one prompt falls on one side, and a prompt
keeps its side when new feedback arrives.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.raw_data import in_eval_split, normalise_prompt
from ppo_core.config import Config
from ppo_core.feedback.rows import (
    PreferencePair,
    feedback_sources,
    load_feedback_file,
    pairs_from_ratings,
)
from ppo_core.files import MAX_COPY_BYTES, copy_regular_file, file_sha256
from ppo_core.preference.pairs import FEEDBACK_FOLDER, read_pair_version
from ppo_core.prompts import PromptFileError, is_chat, parse_messages, project_path

__all__ = ["FeedbackVersion", "prepare_feedback", "publish_feedback", "validate_feedback"]

SPLIT_FILES = ("train.parquet", "eval.parquet")


@dataclass
class FeedbackVersion:
    """The pair version ``prepare`` writes: each split's rows and the manifest."""

    splits: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)

    def write(self, folder: Path) -> None:
        """``folder/feedback/``: the splits (when there are pairs) and the manifest."""
        import pandas as pd

        out = folder / FEEDBACK_FOLDER
        out.mkdir()
        for name, rows in self.splits.items():
            columns = ["prompt", "chosen", "rejected", "id", "source"]
            pd.DataFrame(rows, columns=columns).to_parquet(out / f"{name}.parquet", index=False)
        (out / "manifest.json").write_text(json.dumps(self.manifest, indent=1))


def prepare_feedback(config: Config) -> FeedbackVersion:
    """The pair version of ``data.feedback_dir`` (module docstring); a malformed file is a
    :class:`ppo_core.feedback.fields.FeedbackFileError` naming its file and line before anything is
    written."""
    data = config.data
    pairs: list[PreferencePair] = []
    counts = {"pair_rows": 0, "rating_rows": 0}
    ratings_all = []
    sources = []
    for path in feedback_sources(Path(data.feedback_dir)):
        file_pairs, ratings = load_feedback_file(
            path, max_rows=data.max_rows_per_file, max_bytes=data.max_bytes_per_file
        )
        sources.append(
            {
                "file": project_path(path),
                "sha256": file_sha256(path),
                "rows": len(file_pairs) + len(ratings),
            }
        )
        counts["pair_rows"] += len(file_pairs)
        counts["rating_rows"] += len(ratings)
        pairs += file_pairs
        ratings_all += ratings
    from_ratings, rating_counts = pairs_from_ratings(
        ratings_all,
        normalise_prompt,
        per_prompt=data.max_pairs_per_prompt,
        total=data.max_rating_pairs,
    )
    counts.update({f"ratings_{k}": v for k, v in rating_counts.items()})
    rows, dropped = _distinct_rows([*pairs, *from_ratings])
    counts.update(dropped)
    kinds = {is_chat(pair.prompt) for pair in [*pairs, *from_ratings]}
    if len(kinds) > 1:
        raise PromptFileError(
            f"{data.feedback_dir} holds both plain 'prompt' and chat 'messages' feedback; a "
            "feedback version holds one kind (write a plain prompt as a chat with one user turn)"
        )
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    for row in rows:
        side = (
            "eval" if in_eval_split(row["prompt"], data.split_seed, data.eval_fraction) else "train"
        )
        splits[side].append(row)
    content = hashlib.sha256()
    for side, items in splits.items():
        for row in items:
            content.update(json.dumps([side, row], sort_keys=True).encode() + b"\n")
    manifest = {
        **_empty_manifest(config),
        "content_hash": content.hexdigest() if rows else None,
        "pairs": len(rows),
        "chat": kinds == {True},
        "counts": {**counts, "train": len(splits["train"]), "eval": len(splits["eval"])},
        "sources": sources,
    }
    return FeedbackVersion(splits if rows else {}, manifest)


def _empty_manifest(config: Config) -> dict[str, Any]:
    return {
        "content_hash": None,
        "pairs": 0,
        "chat": False,
        "counts": {},
        "eval_fraction": config.data.eval_fraction,
        "split_seed": config.data.split_seed,
        "sources": [],
    }


def _distinct_rows(pairs: list[PreferencePair]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    seen: set[tuple[str, str, str]] = set()
    rows = []
    dropped = {"empty_prompts": 0, "duplicates": 0}
    for pair in pairs:
        prompt = normalise_prompt(pair.prompt)
        chosen, rejected = pair.chosen.strip(), pair.rejected.strip()
        if not prompt:
            dropped["empty_prompts"] += 1
        elif (prompt, chosen, rejected) in seen:
            dropped["duplicates"] += 1
        else:
            seen.add((prompt, chosen, rejected))
            rows.append(
                {
                    "prompt": prompt,
                    "chosen": chosen,
                    "rejected": rejected,
                    "id": pair.id,
                    "source": pair.source,
                }
            )
    return rows, dropped


def validate_feedback(config: Config) -> Any:
    """Check the interim pair version with Great Expectations; the result (None when there
    are no pairs). Each prompt + reply is counted in tokens of the reward model's tokenizer
    (the base it starts from), as the reward model reads it, and held to
    ``validation.max_tokens``."""
    import pandas as pd

    from flows.feedback_validation import validate_feedback_pairs
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.rewards.classifier import scored_token_ids

    folder = Path(config.data.interim_dir) / FEEDBACK_FOLDER
    if not folder.exists():
        return None  # a version prepared without feedback: published with an empty manifest
    manifest = read_pair_version(folder)
    if not manifest.get("pairs"):
        return None
    for name in SPLIT_FILES:
        path = folder / name
        if path.is_symlink() or not path.is_file():
            raise PromptFileError(f"{path} is not a regular file; run `ppo prepare` again")
    frames = {name: pd.read_parquet(folder / f"{name}.parquet") for name in ("train", "eval")}
    tokenizer = load_tokenizer(
        config.reward_model.base or config.model.policy, config.model.trust_remote_code
    )
    chat = bool(manifest.get("chat"))

    def count_tokens(prompts: list[str], replies: list[str]) -> list[int]:
        # what the reward model reads: the prompt (a chat through its template) and the reply
        return [
            len(scored_token_ids(tokenizer, parse_messages(p, str(folder)) if chat else p, r))
            for p, r in zip(prompts, replies, strict=True)
        ]

    rules = config.validation
    return validate_feedback_pairs(
        frames["train"],
        frames["eval"],
        count_tokens=count_tokens,
        max_tokens=rules.max_tokens,
        min_train_pairs=rules.min_train_pairs,
        min_eval_pairs=rules.min_eval_pairs,
        report_dir=Path(rules.report_dir) / FEEDBACK_FOLDER,
        max_mirrored_share=rules.max_mirrored_share,
    )


def publish_feedback(config: Config, tmp: Path) -> None:
    """Copy the interim pair version into ``tmp/feedback`` (the prepared version being
    published): regular files only, never through a link."""
    source = Path(config.data.interim_dir) / FEEDBACK_FOLDER
    target = tmp / FEEDBACK_FOLDER
    if not source.exists():
        FeedbackVersion(manifest=_empty_manifest(config)).write(tmp)
        return
    target.mkdir()
    names = ["manifest.json"] + [n for n in SPLIT_FILES if (source / n).is_file()]
    for name in names:
        fd = os.open(target / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            copy_regular_file(source / name, fd, MAX_COPY_BYTES)
        finally:
            os.close(fd)
