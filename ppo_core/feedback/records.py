"""The records of a feedback file (layer 2): each JSONL line's object or each Parquet row's
values, with where it is, the file's row and byte caps checked before and while it is read
(:func:`jsonl_records`, :func:`parquet_records`). The rows they hold are read by
:mod:`ppo_core.feedback.rows`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ppo_core.feedback.fields import FEEDBACK_FIELDS, FIELDS_HELP, LIMIT_HINT, FeedbackFileError
from ppo_core.files import printable
from ppo_core.prompts import MAX_LINE_BYTES, _metadata_size, _one_line

__all__ = ["jsonl_records", "parquet_records"]


# --- JSONL ----------------------------------------------------------------------------------


class _DuplicateKeyError(ValueError):
    """A JSON object with a key twice: ``json`` would keep the last value without a word."""


def _object_without_duplicates(items: list[tuple[str, Any]]) -> dict[str, Any]:
    record: dict[str, Any] = {}
    for key, value in items:
        if key in record:
            raise _DuplicateKeyError(key)
        record[key] = value
    return record


def jsonl_records(
    path: Path, name: str, max_rows: int, max_bytes: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each non-blank line's object, and where it is
    (``<file> line <n>``), the caps checked before and while the file is read."""
    size = path.stat().st_size
    if size > max_bytes:
        raise FeedbackFileError(
            f"{name}: {size} bytes, more than the limit of {max_bytes} bytes a file{LIMIT_HINT}"
        )
    with path.open("rb") as handle:
        number = read = rows = 0
        while raw := handle.readline(MAX_LINE_BYTES + 1):
            number += 1
            where = f"{name} line {number}"
            read += len(raw)
            if read > max_bytes:  # the file grew while it was read
                raise FeedbackFileError(
                    f"{name}: at least {read} bytes, more than the limit of {max_bytes} bytes "
                    f"a file{LIMIT_HINT}"
                )
            if len(raw) > MAX_LINE_BYTES:
                raise FeedbackFileError(
                    f"{where}: longer than the limit of {MAX_LINE_BYTES} bytes a line"
                )
            record = _json_object(raw, where)
            if record is None:
                continue
            rows += 1
            if rows > max_rows:
                raise FeedbackFileError(
                    f"{where}: more than the limit of {max_rows} rows a file{LIMIT_HINT}"
                )
            yield where, record


def _json_object(raw: bytes, where: str) -> dict[str, Any] | None:
    """The JSON object of one line, None for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FeedbackFileError(f"{where}: not valid UTF-8 ({exc.reason})") from None
    if not text.strip():
        return None
    try:
        record = json.loads(text, object_pairs_hook=_object_without_duplicates)
    except _DuplicateKeyError as exc:
        key = printable(str(exc.args[0]))[:40]
        raise FeedbackFileError(f"{where}: the key {key!r} appears twice in one object") from None
    except json.JSONDecodeError as exc:
        raise FeedbackFileError(f"{where}: not valid JSON ({exc.msg})") from None
    except RecursionError:  # caught before ValueError: deep nesting is its own message
        raise FeedbackFileError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        reason = " ".join(str(exc).split(":")[0].split())
        raise FeedbackFileError(f"{where}: not valid JSON ({reason})") from None
    if not isinstance(record, dict):
        raise FeedbackFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


# --- Parquet --------------------------------------------------------------------------------


def parquet_records(
    path: Path, name: str, max_rows: int, max_bytes: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each row's values by column, and where it is (``<file> row <n>``), after the
    whole file is measured against the caps.

    Order matters, as in :func:`ppo_core.prompts.load_prompts`: the schema and the metadata
    alone (columns, rows, the data's declared uncompressed size), then the columns a row group
    at a time with every text leaf (a ``messages`` list's contents too) read as a dictionary,
    its length added up from the dictionary without any row's text being built, and only under
    every cap the Python values built.
    """
    import pyarrow.parquet as pq  # here: only a Parquet file needs pyarrow

    try:
        plain = pq.ParquetFile(path)
        schema = plain.schema_arrow
        leaves = [plain.schema.column(i) for i in range(len(plain.schema))]
        text_leaves = [leaf.path for leaf in leaves if leaf.physical_type == "BYTE_ARRAY"]
        file = pq.ParquetFile(path, read_dictionary=text_leaves)
        rows, declared = _metadata_size(file.metadata, "")
    except Exception as exc:  # pyarrow raises many kinds for a damaged or foreign file
        raise FeedbackFileError(f"{name}: not a readable parquet file ({_one_line(exc)})") from None
    columns = _parquet_columns(schema, name)
    if rows > max_rows:
        raise FeedbackFileError(
            f"{name}: {rows} rows, more than the limit of {max_rows} rows a file{LIMIT_HINT}"
        )
    if declared > max_bytes:
        raise FeedbackFileError(
            f"{name}: its data is {declared} bytes uncompressed, more than the limit of "
            f"{max_bytes} bytes a file{LIMIT_HINT}"
        )
    tables = _measured_row_groups(file, name, columns, rows, max_rows, max_bytes)
    values = {column: _column_values(tables, column, name) for column in columns}
    _check_value_sizes(values, name)
    if "id" in values and _is_float_column(schema, "id"):
        values["id"] = [_integral_id(value) for value in values["id"]]
    for row in range(sum(table.num_rows for table in tables)):
        yield f"{name} row {row}", {column: values[column][row] for column in columns}


def _parquet_columns(schema: Any, name: str) -> list[str]:
    """The columns to read: every column but a pandas index, refused when one is not a
    feedback field or two share a name."""
    try:
        metadata = schema.pandas_metadata or {}
        described = list(metadata.get("index_columns", []))
    except Exception:  # metadata that is not pandas' JSON: no index is known to be there
        described = []
    # a range index is described (a dict), not stored; any other index is a column, named here
    index = {column for column in described if isinstance(column, str)}
    columns = [column for column in schema.names if column not in index]
    unknown = [column for column in columns if column not in FEEDBACK_FIELDS]
    if unknown:
        names = ", ".join(repr(printable(str(column))[:40]) for column in unknown)
        word = "column" if len(unknown) == 1 else "columns"
        raise FeedbackFileError(f"{name}: unknown {word} {names}; {FIELDS_HELP}")
    repeated = next((column for column in columns if columns.count(column) > 1), None)
    if repeated is not None:
        raise FeedbackFileError(f"{name}: {columns.count(repeated)} columns named {repeated!r}")
    return columns


def _measured_row_groups(
    file: Any, name: str, columns: list[str], rows: int, max_rows: int, max_bytes: int
) -> list[Any]:
    """The file's row groups (``columns`` only, text as dictionaries), refused as soon as the
    rows or the bytes their values take (text lengths from the dictionaries, fixed-width
    columns by their width) pass a cap."""
    # fixed-width values (numbers, fixed-size binary) are not dictionaries: count them by width
    # before reading, as a column stored with a dictionary is small on disk however many rows
    measured = rows * sum(_byte_width(file.schema_arrow.field(column).type) for column in columns)
    read = 0
    tables = []
    for group in range(file.num_row_groups):
        try:
            table = file.read_row_group(group, columns=columns)
            measured += sum(
                _text_bytes(chunk) for column in table.columns for chunk in column.chunks
            )
        # a damaged file: pages that do not decode, indices past a dictionary
        except Exception as exc:
            raise FeedbackFileError(
                f"{name}: not a readable parquet file ({_one_line(exc)})"
            ) from None
        read += table.num_rows
        tables.append(table)
        if read > max_rows:  # metadata that does not match the data
            raise FeedbackFileError(
                f"{name}: at least {read} rows, more than the limit of {max_rows} rows a "
                f"file{LIMIT_HINT}"
            )
        if measured > max_bytes:
            raise FeedbackFileError(
                f"{name}: its values are at least {measured} bytes, more than the limit of "
                f"{max_bytes} bytes a file{LIMIT_HINT}"
            )
    return tables


def _byte_width(kind: Any) -> int:
    """The bytes a value of a fixed-width Arrow type takes (a bool counted as one), else 0."""
    try:
        bits = kind.bit_width
    except ValueError:  # a variable-width type: text, lists, structs
        return 0
    return max(1, bits // 8) if bits else 0


def _text_bytes(array: Any) -> int:
    """The bytes of text and binary in ``array``, nested ones included; a dictionary's values
    are measured through it, no row's value copied."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_dictionary(kind):
        if not _holds_bytes(kind.value_type):
            return 0
        lengths = pc.take(pc.binary_length(array.dictionary), array.indices)
        return pc.sum(lengths).as_py() or 0
    if _holds_bytes(kind):
        return pc.sum(pc.binary_length(array)).as_py() or 0
    if pa.types.is_map(kind):
        return _text_bytes(array.keys) + _text_bytes(array.items)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _text_bytes(array.flatten())
    if pa.types.is_struct(kind):
        return sum(_text_bytes(child) for child in array.flatten())
    return 0


def _holds_bytes(kind: Any) -> bool:
    """Whether an Arrow type is text or binary of variable length."""
    import pyarrow as pa

    checks = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary)
    return any(check(kind) for check in (*checks, pa.types.is_large_binary))


def _column_values(tables: list[Any], column: str, name: str) -> list[Any]:
    """The Python values of ``column`` over every row group; text not valid UTF-8 (a damaged
    or foreign file) is named by its first row."""
    values: list[Any] = []
    for table in tables:
        chunked = table.column(column)
        try:
            values.extend(chunked.to_pylist())
        except UnicodeDecodeError:
            for row, scalar in enumerate(chunked):
                try:
                    scalar.as_py()
                except UnicodeDecodeError:
                    raise FeedbackFileError(
                        f"{name} row {len(values) + row}: {column!r} is not valid UTF-8"
                    ) from None
            raise FeedbackFileError(f"{name}: column {column!r} is not valid UTF-8") from None
    return values


def _check_value_sizes(values: dict[str, list[Any]], name: str) -> None:
    """Each value at most :data:`~ppo_core.prompts.MAX_LINE_BYTES` characters (a chat's turns'
    contents together), as a JSONL feedback line is bounded: a few kB of Parquet can hold a
    reply of megabytes, which the whole file's cap alone would let through."""
    for column, column_values in values.items():
        for row, value in enumerate(column_values):
            if isinstance(value, str):
                size = len(value)
            elif isinstance(value, list):
                size = sum(
                    len(str(turn.get("content", ""))) if isinstance(turn, dict) else len(str(turn))
                    for turn in value
                )
            else:
                continue
            if size > MAX_LINE_BYTES:
                raise FeedbackFileError(
                    f"{name} row {row}: {column!r} is {size} characters long, over the limit of "
                    f"{MAX_LINE_BYTES} a value (a JSONL feedback line's limit)"
                )


def _is_float_column(schema: Any, column: str) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_floating(schema.field(column).type))


def _integral_id(value: Any) -> Any:
    """An id of a float column as the integer it is: pandas stores a column of integers with a
    missing value as floats, so ``3.0`` there means the id 3. Other values are left for the
    row's check to refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
