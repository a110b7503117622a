"""The ``prepare`` stage: every raw prompt file read, cleaned, deduplicated and split by a hash of
each prompt into a versioned train/eval set (``train.parquet``, ``eval.parquet``,
``manifest.json``), with the feedback's pair version beside it. Registered as a stage in
:mod:`flows.stages`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from flows.feedback_data import prepare_feedback
from flows.raw_data import (
    in_eval_split,
    normalise_prompt,
    raw_sources,
    read_raw_prompts,
    read_raw_references,
)
from ppo_core.config import Config
from ppo_core.files import atomic_folder, file_sha256
from ppo_core.files.artifacts import DATA_MANIFEST
from ppo_core.prompts import (
    CHAT_FIELD,
    PromptFileError,
    is_chat,
    parquet_size,
    project_path,
)
from ppo_core.references import (
    REFERENCES_COLUMN,
    Reference,
    check_reference_fields,
    reference_json,
)

__all__ = ["prepare_prompts"]


def prepare_prompts(config: Config) -> Path:
    """Clean, deduplicate and split the raw prompts into a versioned train/eval set.

    Reads every ``*.jsonl`` / ``*.parquet`` in ``data.raw_dir`` (sorted by name), strips and
    normalises whitespace, drops empty prompts and duplicates (first occurrence wins), splits by a
    hash of each prompt, and writes ``train.parquet``, ``eval.parquet`` and ``manifest.json``
    (content hash, counts, source files with their hashes) into ``data.interim_dir``, atomically;
    ``validate`` publishes it to ``data.prepared_dir``. The feedback in ``data.feedback_dir``
    becomes a pair version in ``feedback/`` beside the splits (:mod:`flows.feedback_data`).
    A malformed line fails the stage naming its file and line; nothing is written then. So does a
    raw file over ``data.max_rows_per_file`` or ``data.max_bytes_per_file``, and a split over them
    (training and evaluation read the splits under the same caps). The manifest names each source
    as ``project_path`` does: relative to the working folder, or by its name alone outside it.
    """
    import pandas as pd

    data = config.data
    check_reference_fields(data.reference_fields, data.prompt_field)
    prompts, counts, source_info, chat, references = _distinct_prompts(config)
    column = CHAT_FIELD if chat else data.prompt_field
    evals = [p for p in prompts if in_eval_split(p, data.split_seed, data.eval_fraction)]
    trains = [p for p in prompts if not in_eval_split(p, data.split_seed, data.eval_fraction)]
    if not trains or not evals:
        raise PromptFileError(
            f"{len(prompts)} distinct prompts give {len(trains)} train and {len(evals)} eval "
            f"prompts with data.eval_fraction={data.eval_fraction}; both splits need prompts"
        )
    # Each split is a prompt file that `ppo train` or `ppo evaluate` reads under the same caps.
    readers = {"train": "`ppo train`", "eval": "`ppo evaluate`"}
    for split, items in (("train", trains), ("eval", evals)):
        if len(items) > data.max_rows_per_file:
            raise PromptFileError(
                f"{Path(data.interim_dir) / f'{split}.parquet'} would hold {len(items)} prompts, "
                f"more than data.max_rows_per_file={data.max_rows_per_file}, so {readers[split]} "
                "could not read it; raise the limit"
            )
    content = hashlib.sha256()
    for split, items in (("train", trains), ("eval", evals)):
        for prompt in items:
            content.update(f"{split}\x00{prompt}\n".encode())
            if references:  # a changed answer is a new data version
                content.update(f"{reference_json(references[prompt])}\n".encode())
    # the feedback's pair version, read (and refused when malformed) before anything is written
    feedback = prepare_feedback(config)
    manifest = {
        "content_hash": content.hexdigest(),
        "counts": {**counts, "train": len(trains), "eval": len(evals)},
        "eval_fraction": data.eval_fraction,
        "split_seed": data.split_seed,
        "sources": source_info,
        **({"reference_fields": list(data.reference_fields)} if references else {}),
    }

    def write(tmp: Path) -> None:
        for split, items in (("train", trains), ("eval", evals)):
            columns = {column: items}
            if references:  # each row's fields beside its prompt: they share a side
                columns[REFERENCES_COLUMN] = [reference_json(references[p]) for p in items]
            pd.DataFrame(columns).to_parquet(tmp / f"{split}.parquet", index=False)
            # the size a reader measures first, known only once written
            _, size = parquet_size(tmp / f"{split}.parquet", column)
            if size > data.max_bytes_per_file:
                raise PromptFileError(
                    f"{Path(data.interim_dir) / f'{split}.parquet'} would hold {size} bytes "
                    f"uncompressed, more than data.max_bytes_per_file={data.max_bytes_per_file}, "
                    f"so {readers[split]} could not read it; raise the limit"
                )
        (tmp / DATA_MANIFEST).write_text(json.dumps(manifest, indent=1))
        feedback.write(tmp)

    return atomic_folder(data.interim_dir, write)


def _distinct_prompts(
    config: Config,
) -> tuple[list[str], dict[str, int], list[dict], bool, dict[str, Reference]]:
    """The normalised, distinct prompts of every raw file in order (first occurrence wins),
    with the counts of raw, empty and duplicate rows, each source file's record, whether they
    are chats, and each kept prompt's reference fields (``data.reference_fields``; empty
    without them); a mix of plain and chat files is refused naming one of each."""
    data = config.data
    sources = raw_sources(Path(data.raw_dir))
    if not sources:
        raise PromptFileError(f"no .jsonl or .parquet prompt files in {str(Path(data.raw_dir))!r}")
    seen: set[str] = set()
    prompts: list[str] = []
    references: dict[str, Reference] = {}
    counts = {"raw": 0, "empty": 0, "duplicates": 0}
    source_info = []
    first_of_kind: dict[bool, str] = {}  # is_chat -> the first source file of that kind
    for source in sources:
        rows = read_raw_prompts(config, source)
        fields = read_raw_references(config, source)
        source_info.append(
            {"file": project_path(source), "sha256": file_sha256(source), "rows": len(rows)}
        )
        for index, raw in enumerate(rows):
            first_of_kind.setdefault(is_chat(raw), project_path(source))
            counts["raw"] += 1
            prompt = normalise_prompt(raw)
            if not prompt:
                counts["empty"] += 1
            elif prompt in seen:
                counts["duplicates"] += 1
            else:
                seen.add(prompt)
                prompts.append(prompt)
                if fields:
                    references[prompt] = fields[index]
    if len(first_of_kind) > 1:
        raise PromptFileError(
            f"{first_of_kind[False]} holds plain {data.prompt_field!r} rows and "
            f"{first_of_kind[True]} chat {CHAT_FIELD!r} rows; a data version holds one kind "
            "(write a plain prompt as a chat with one user turn to mix them)"
        )
    return prompts, counts, source_info, bool(first_of_kind.get(True)), references
