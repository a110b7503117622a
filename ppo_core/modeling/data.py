"""Reading prompt files (layer 2): JSONL with one object a line, or Parquet."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

__all__ = ["PromptFileError", "load_prompts", "read_manifest_hash"]


MAX_LINE_BYTES = 1 << 20  # one prompt record; longer lines are rejected before being read whole


class PromptFileError(ValueError):
    """A prompt file is missing, malformed or empty; the message names the file and line."""


def load_prompts(path: str | Path, field: str = "prompt", allow_empty: bool = False) -> list[str]:
    """The prompts of a ``.jsonl`` or ``.parquet`` file, in file order.

    Raises:
        PromptFileError: missing file, unknown extension, a line that is not a JSON object with a
            string ``field`` (named by line number), or no prompt at all. Blank prompts are an
            error too, unless ``allow_empty`` (the prepare stage drops and counts them).
    """
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file {str(path)!r} does not exist")
    if path.suffix == ".parquet":
        import pandas as pd

        try:
            frame = pd.read_parquet(path)
        except Exception as exc:  # pyarrow raises many kinds for a damaged or foreign file
            raise PromptFileError(
                f"{path}: not a readable parquet file ({_one_line(exc)})"
            ) from None
        if field not in frame.columns:
            raise PromptFileError(
                f"{path}: no column {field!r} (columns: {', '.join(map(str, frame.columns))})"
            )
        try:
            values = frame[field].tolist()
        except Exception as exc:  # strings are decoded only here: invalid UTF-8 in a damaged file
            raise PromptFileError(_unreadable_column(path, field, exc)) from None
        prompts = []
        for row, value in enumerate(values):
            if not isinstance(value, str) or not (value.strip() or allow_empty):
                raise PromptFileError(f"{path}: row {row}: {field!r} is not a non-empty string")
            if len(value) > MAX_LINE_BYTES:
                raise PromptFileError(
                    f"{path}: row {row}: {field!r} is {len(value)} characters "
                    f"long, over the limit of {MAX_LINE_BYTES}"
                )
            prompts.append(value)
    elif path.suffix in (".jsonl", ".json"):
        prompts = []
        with path.open("rb") as handle:
            number = 0
            while raw := handle.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(raw) > MAX_LINE_BYTES:
                    raise PromptFileError(
                        f"{path}:{number}: line longer than the limit of {MAX_LINE_BYTES} bytes"
                    )
                prompts.extend(_parse_line(path, number, raw, field, allow_empty))
    else:
        raise PromptFileError(
            f"{path}: unknown prompt file type {path.suffix!r}; use .jsonl or .parquet"
        )
    if not prompts and not allow_empty:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def _parse_line(path: Path, number: int, raw: bytes, field: str, allow_empty: bool) -> list[str]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{path}:{number}: not valid UTF-8 ({exc.reason})") from None
    if not text.strip():
        return []
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    except RecursionError:  # caught before ValueError: deep nesting is its own message
        raise PromptFileError(f"{path}:{number}: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        reason = " ".join(str(exc).split(":")[0].split())
        raise PromptFileError(f"{path}:{number}: not valid JSON ({reason})") from None
    if not isinstance(record, dict):
        raise PromptFileError(
            f"{path}:{number}: expected a JSON object, got {type(record).__name__}"
        )
    value = record.get(field)
    if not isinstance(value, str) or not (value.strip() or allow_empty):
        raise PromptFileError(
            f"{path}:{number}: field {field!r} is missing or not a non-empty string"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a JSON escape of a lone surrogate, e.g. "\\ud800"
        raise PromptFileError(
            f"{path}:{number}: field {field!r} holds a lone UTF-16 surrogate, which is not text"
        ) from None
    return [value]


def _one_line(exc: BaseException) -> str:
    """``Kind: message`` of an exception on one line, at most 200 characters of the message."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _unreadable_column(path: Path, field: str, exc: BaseException) -> str:
    """The message for a column that pyarrow read but cannot turn into Python strings, naming the
    first row that fails (found on this error path only)."""
    import pyarrow.parquet as pq

    with contextlib.suppress(Exception):  # the reader failed again: report the first error
        for row, value in enumerate(pq.read_table(path, columns=[field]).column(field)):
            try:
                value.as_py()
            except UnicodeDecodeError:
                return f"{path}: row {row}: {field!r} is not valid UTF-8"
    return f"{path}: column {field!r} is not readable ({_one_line(exc)})"


def read_manifest_hash(prompt_file: str | Path) -> str | None:
    """The content hash of the data version, from ``manifest.json`` beside the prompt file."""
    manifest = Path(prompt_file).with_name("manifest.json")
    if not manifest.is_file():
        return None
    try:
        return json.loads(manifest.read_text()).get("content_hash")
    except (json.JSONDecodeError, AttributeError):
        return None
