"""Reference fields (layer 2): what a prompt row carries beside its prompt for the reward to
check replies against (``data.reference_fields``: an ``answer``, ``tests``, any JSON value).

A raw JSONL row holds them as top-level keys beside ``prompt`` or ``messages``; a raw Parquet
file as text columns of the same names. ``prepare`` writes them into each split as one text
column, :data:`REFERENCES_COLUMN`, the JSON object of a row's fields, so that they travel with
their prompt through the split and the data version. Every value is bounded as a prompt is
(:data:`~ppo_core.prompts.MAX_LINE_BYTES` of JSON), and a row without a declared field is a
:class:`~ppo_core.prompts.PromptFileError` naming the file, the line (or row) and the field.
Read after :func:`~ppo_core.prompts.load_prompts` has accepted the same file: rows line up.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ppo_core.prompts import (
    CHAT_FIELD,
    MAX_BYTES_PER_FILE,
    MAX_LINE_BYTES,
    MAX_ROWS_PER_FILE,
    PromptFileError,
    parquet_text_column,
)

__all__ = [
    "REFERENCES_COLUMN",
    "Reference",
    "batch_references",
    "check_reference_fields",
    "load_references",
    "reference_json",
]

REFERENCES_COLUMN = "references"
"""The column of a prepared split holding each row's reference fields as a JSON object."""

Reference = dict[str, Any]
"""One row's reference fields, ``{field: value}``."""


def check_reference_fields(fields: Sequence[str], prompt_field: str) -> None:
    """Refuse ``data.reference_fields`` that are not distinct names other than the prompt's
    own fields."""
    taken = {prompt_field, CHAT_FIELD, REFERENCES_COLUMN}
    for name in fields:
        if not isinstance(name, str) or not name.strip():
            raise PromptFileError(f"data.reference_fields holds {name!r}, not a field name")
        if name in taken:
            raise PromptFileError(
                f"data.reference_fields holds {name!r}, which names the prompt's own column"
            )
    if len(set(fields)) != len(fields):
        raise PromptFileError(f"data.reference_fields names a field twice: {list(fields)}")


def reference_json(reference: Mapping[str, Any]) -> str:
    """A row's fields as the JSON text a split stores (keys sorted: one text per content)."""
    return json.dumps(dict(reference), sort_keys=True, ensure_ascii=False)


def batch_references(
    rows: Sequence[Reference] | None, fields: Sequence[str]
) -> dict[str, list[Any]] | None:
    """``{field: [value per row]}`` of a batch's rows, what a reward receives; None without
    reference fields."""
    if rows is None or not fields:
        return None
    return {name: [row[name] for row in rows] for name in fields}


def load_references(
    path: str | Path,
    fields: Sequence[str],
    *,
    max_rows: int = MAX_ROWS_PER_FILE,
    max_bytes: int = MAX_BYTES_PER_FILE,
) -> list[Reference]:
    """Each row's ``fields`` of a prompt file, in file order (a prepared split's
    :data:`REFERENCES_COLUMN`, a raw Parquet file's text columns, a raw JSONL row's keys);
    ``[]`` when no field is declared."""
    if not fields:
        return []
    path = Path(path)
    if path.suffix == ".parquet":
        return _parquet_references(path, fields, max_rows, max_bytes)
    rows: list[Reference] = []
    with path.open("rb") as handle:
        for number, raw in enumerate(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise PromptFileError(
                    f"{path}:{number}: line longer than the limit of {MAX_LINE_BYTES} bytes"
                )
            text = raw.decode("utf-8", errors="replace")
            if not text.strip():
                continue  # as load_prompts skips it
            record = json.loads(text)
            rows.append(_fields_of(record, fields, f"{path}:{number}"))
            if len(rows) > max_rows:
                raise PromptFileError(
                    f"{path}:{number}: more than data.max_rows_per_file={max_rows} rows"
                )
    return rows


def _fields_of(record: Mapping[str, Any], fields: Sequence[str], where: str) -> Reference:
    """``fields`` of one row, each present, not null and at most 1 MiB of JSON."""
    found: Reference = {}
    for name in fields:
        if name not in record or record[name] is None:
            raise PromptFileError(f"{where}: reference field {name!r} is missing")
        value = record[name]
        size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", errors="replace"))
        if size > MAX_LINE_BYTES:
            raise PromptFileError(
                f"{where}: reference field {name!r} is {size} bytes of JSON, over the limit "
                f"of {MAX_LINE_BYTES}"
            )
        found[name] = value
    return found


def _parquet_references(
    path: Path, fields: Sequence[str], max_rows: int, max_bytes: int
) -> list[Reference]:
    """A prepared split's JSON column, or a raw file's text column per field."""
    import pyarrow.parquet as pq

    try:
        names = set(pq.ParquetFile(path).schema_arrow.names)
    except Exception as exc:  # a damaged file: load_prompts has named it already
        raise PromptFileError(f"{path}: not a readable parquet file ({exc})") from None
    if REFERENCES_COLUMN in names:
        values = parquet_text_column(path, REFERENCES_COLUMN, max_rows, max_bytes)
        rows = []
        for row, value in enumerate(values):
            try:
                record = json.loads(value) if isinstance(value, str) else None
            except (ValueError, RecursionError):
                record = None
            if not isinstance(record, dict):
                raise PromptFileError(
                    f"{path}: row {row}: {REFERENCES_COLUMN!r} is not the JSON of an object"
                )
            rows.append(_fields_of(record, fields, f"{path}: row {row}"))
        return rows
    columns = {}
    for name in fields:
        if name not in names:
            raise PromptFileError(f"{path}: no column for the reference field {name!r}")
        columns[name] = parquet_text_column(path, name, max_rows, max_bytes)
    count = len(next(iter(columns.values())))
    return [
        _fields_of({name: columns[name][row] for name in fields}, fields, f"{path}: row {row}")
        for row in range(count)
    ]
