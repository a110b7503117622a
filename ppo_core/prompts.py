"""Reading prompt files (layer 2): JSONL with one object a line, or Parquet.

A row holds either a plain ``prompt`` string (``data.prompt_field``), which the policy continues,
or a chat: ``messages``, a list of ``{"role": ..., "content": ...}`` turns, which the policy's chat
template renders with the generation prompt (:func:`ppo_core.models.generation.prompt_token_ids`).
In Parquet the ``messages`` column holds each row's list as JSON text. A chat comes back from
:func:`load_prompts` as its list of message dicts, a plain prompt as its string (:data:`Prompt`).

A file is bounded before it is read whole: at most ``max_rows`` prompts and ``max_bytes`` bytes
(``data.max_rows_per_file``, ``data.max_bytes_per_file``). A Parquet file is measured first by
its metadata (rows, the prompt column's uncompressed size) and then by the length of its text,
read as a dictionary so that repeated strings are counted without being built: a file of a few
hundred bytes can hold gigabytes of one string repeated. pyarrow is imported where a Parquet
file is read, so that the config (which imports this module for its size limits) loads quickly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ppo_core.files.artifacts import DATA_MANIFEST, VALIDATION_RECORD

__all__ = [
    "CHAT_FIELD",
    "CHAT_ROLES",
    "MAX_BYTES_PER_FILE",
    "MAX_LINE_BYTES",
    "MAX_ROWS_PER_FILE",
    "Message",
    "Prompt",
    "PromptFileError",
    "chat_json",
    "is_chat",
    "load_prompts",
    "parquet_size",
    "parquet_text_column",
    "parse_messages",
    "project_path",
    "prompt_text",
    "read_manifest_hash",
    "read_validation_record",
]

Message = dict[str, str]
"""One chat turn: ``{"role": "user", "content": "..."}``."""
Prompt = str | list[Message]
"""A plain prompt (text the policy continues) or a chat (turns its chat template renders)."""

CHAT_FIELD = "messages"
"""The field (JSONL) or column (Parquet, JSON text) of a chat prompt."""
CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat turn may have; a chat needs at least one ``user`` turn."""


MAX_LINE_BYTES = 1 << 20  # one prompt record; longer lines are rejected before being read whole
# The defaults of data.max_rows_per_file and data.max_bytes_per_file.
MAX_ROWS_PER_FILE = 1_000_000
MAX_BYTES_PER_FILE = 1 << 30
_RAISE = "; split the file or raise the limit"


class PromptFileError(ValueError):
    """A prompt file is missing, malformed or empty; the message names the file and line."""


def is_chat(prompt: Prompt) -> bool:
    """Whether ``prompt`` is a chat (a list of turns) rather than plain text."""
    return not isinstance(prompt, str)


def parse_messages(value: Any, where: str) -> list[Message]:
    """``value`` as a chat: a non-empty list of ``{"role", "content"}`` objects with known roles
    (:data:`CHAT_ROLES`), string contents and at least one ``user`` turn; a copy holding exactly
    those two keys. A string is read as the JSON of such a list (Parquet's form).

    Raises:
        PromptFileError: naming ``where`` (file and line or row), the turn and what is wrong.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError, ValueError):
            raise PromptFileError(
                f"{where}: {CHAT_FIELD!r} is text that is not the JSON of a list of turns"
            ) from None
    if not isinstance(value, list) or not value:
        raise PromptFileError(
            f"{where}: {CHAT_FIELD!r} must be a non-empty list of "
            '{"role": ..., "content": ...} turns'
        )
    messages = []
    for turn, message in enumerate(value):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            keys = sorted(message) if isinstance(message, dict) else type(message).__name__
            raise PromptFileError(
                f"{where}: {CHAT_FIELD}[{turn}] must be an object with exactly the keys role "
                f"and content, got {keys}"
            )
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise PromptFileError(
                f"{where}: {CHAT_FIELD}[{turn}] has the unknown role {str(role)[:40]!r}; "
                f"roles are {', '.join(CHAT_ROLES)}"
            )
        if not isinstance(content, str):
            raise PromptFileError(
                f"{where}: {CHAT_FIELD}[{turn}].content is {type(content).__name__}, not text"
            )
        messages.append({"role": role, "content": content})
    if not any(message["role"] == "user" for message in messages):
        raise PromptFileError(f"{where}: {CHAT_FIELD!r} has no user turn")
    return messages


def chat_json(messages: list[Message]) -> str:
    """The canonical JSON text of a chat: how a prepared split stores it, dedups and hashes it."""
    return json.dumps(messages, ensure_ascii=False, separators=(",", ":"))


def prompt_text(prompt: Prompt) -> str:
    """A prompt as a person reads it in a log or a report: plain text as it is, a chat as one
    ``role: content`` line per turn."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message['role']}: {message['content']}" for message in prompt)


def load_prompts(
    path: str | Path,
    field: str = "prompt",
    allow_empty: bool = False,
    *,
    max_rows: int = MAX_ROWS_PER_FILE,
    max_bytes: int = MAX_BYTES_PER_FILE,
) -> list[Prompt]:
    """The prompts of a ``.jsonl`` or ``.parquet`` file, in file order: a string for a row with
    ``field``, a list of turns for a row with ``messages`` (:func:`parse_messages`).

    Raises:
        PromptFileError: missing file, unknown extension, a line that is not a JSON object with a
            string ``field`` or a valid ``messages`` list (named by line number), or no prompt at
            all. Blank prompts (a chat whose turns are all blank) are an error too, unless
            ``allow_empty`` (the prepare stage drops and counts them). More than ``max_rows``
            prompts or ``max_bytes`` bytes (module docstring), naming the config key that sets
            the limit.
    """
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file {str(path)!r} does not exist")
    prompts: list[Prompt] = []
    if path.suffix == ".parquet":
        column, values = _parquet_values(path, field, max_rows, max_bytes)
        for row, value in enumerate(values):
            if not isinstance(value, str) or not (value.strip() or allow_empty):
                kind = (
                    "the JSON text of a list of turns (Parquet stores a chat as text)"
                    if column != field
                    else "a non-empty string"
                )
                raise PromptFileError(f"{path}: row {row}: {column!r} is not {kind}")
            if len(value) > MAX_LINE_BYTES:
                raise PromptFileError(
                    f"{path}: row {row}: {column!r} is {len(value)} characters "
                    f"long, over the limit of {MAX_LINE_BYTES}"
                )
            if column == field:
                prompts.append(value)
            else:
                chat = parse_messages(value, f"{path}: row {row}")
                _check_not_blank(chat, allow_empty, f"{path}: row {row}")
                prompts.append(chat)
    elif path.suffix in (".jsonl", ".json"):
        size = path.stat().st_size
        if size > max_bytes:
            raise PromptFileError(
                f"{path}: {size} bytes, more than data.max_bytes_per_file={max_bytes}{_RAISE}"
            )
        with path.open("rb") as handle:
            number = read = 0
            while raw := handle.readline(MAX_LINE_BYTES + 1):
                number += 1
                read += len(raw)
                if read > max_bytes:  # the file grew while it was read
                    raise PromptFileError(
                        f"{path}: at least {read} bytes, more than "
                        f"data.max_bytes_per_file={max_bytes}{_RAISE}"
                    )
                if len(raw) > MAX_LINE_BYTES:
                    raise PromptFileError(
                        f"{path}:{number}: line longer than the limit of {MAX_LINE_BYTES} bytes"
                    )
                prompts.extend(_parse_line(path, number, raw, field, allow_empty))
                if len(prompts) > max_rows:
                    raise PromptFileError(
                        f"{path}:{number}: more than data.max_rows_per_file={max_rows} "
                        f"prompts{_RAISE}"
                    )
    else:
        raise PromptFileError(
            f"{path}: unknown prompt file type {path.suffix!r}; use .jsonl or .parquet"
        )
    if not prompts and not allow_empty:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def _check_not_blank(chat: list[Message], allow_empty: bool, where: str) -> None:
    if not allow_empty and not any(message["content"].strip() for message in chat):
        raise PromptFileError(f"{where}: every turn of {CHAT_FIELD!r} is blank")


def _parse_line(path: Path, number: int, raw: bytes, field: str, allow_empty: bool) -> list[Prompt]:
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
    if field not in record and CHAT_FIELD in record:
        chat = parse_messages(record[CHAT_FIELD], f"{path}:{number}")
        _check_not_blank(chat, allow_empty, f"{path}:{number}")
        _check_encodable(path, number, CHAT_FIELD, chat_json(chat))
        return [chat]
    value = record.get(field)
    if not isinstance(value, str) or not (value.strip() or allow_empty):
        raise PromptFileError(
            f"{path}:{number}: field {field!r} is missing or not a non-empty string (a chat "
            f"row has a {CHAT_FIELD!r} list instead)"
        )
    _check_encodable(path, number, field, value)
    return [value]


def _check_encodable(path: Path, number: int, field: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a JSON escape of a lone surrogate, e.g. "\\ud800"
        raise PromptFileError(
            f"{path}:{number}: field {field!r} holds a lone UTF-16 surrogate, which is not text"
        ) from None


def _one_line(exc: BaseException) -> str:
    """``Kind: message`` of an exception on one line, at most 200 characters of the message."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _parquet_values(path: Path, field: str, max_rows: int, max_bytes: int) -> tuple[str, list[Any]]:
    """The column read (``field``, else ``messages`` when only that one is there) and its
    values, after the file is measured against the caps.

    Order matters: the metadata alone (rows, the column's declared uncompressed size), then the
    column read as a dictionary a row group at a time (its distinct values once, an index a row)
    and the length of its text added up from those, and only under every cap the values built.
    """
    import pyarrow.parquet as pq  # here, as in the helpers: only a Parquet file needs pyarrow

    field, text = _parquet_column(path, field)
    try:
        # read_dictionary applies to text (byte-array) columns only
        file = pq.ParquetFile(path, read_dictionary=[field] if text else None)
        rows, declared = _metadata_size(file.metadata, field)
    except Exception as exc:
        raise PromptFileError(f"{path}: not a readable parquet file ({_one_line(exc)})") from None
    if rows > max_rows:
        raise PromptFileError(
            f"{path}: {rows} rows, more than data.max_rows_per_file={max_rows}{_RAISE}"
        )
    if declared > max_bytes:
        raise PromptFileError(
            f"{path}: its data is {declared} bytes uncompressed, more than "
            f"data.max_bytes_per_file={max_bytes}{_RAISE}"
        )
    if not text:
        # numbers, bytes, lists, nulls...: no row holds a string, so the first one is the error
        # (the caller names it), and nothing needs to be read
        return field, [None] * min(rows, 1)
    chunks = _measured_chunks(file, path, field, max_rows, max_bytes)
    values: list[Any] = []
    for offset, chunk in enumerate(chunks):
        try:
            distinct = chunk.dictionary.to_pylist()  # strings are decoded only here
        except UnicodeDecodeError:
            start = sum(len(earlier) for earlier in chunks[:offset])
            raise PromptFileError(_invalid_utf8(path, field, chunk, start)) from None
        values.extend(None if i is None else distinct[i] for i in chunk.indices.to_pylist())
    return field, values


def parquet_text_column(path: Path, column: str, max_rows: int, max_bytes: int) -> list[Any]:
    """The values of the text column ``column`` of a Parquet file (None for a null), measured
    against the caps as a prompt column is; a column that does not hold text is refused."""
    found, text = _parquet_column(path, column)
    if found != column or not text:
        raise PromptFileError(f"{path}: column {column!r} does not hold text")
    return _parquet_values(path, column, max_rows, max_bytes)[1]


def _parquet_column(path: Path, field: str) -> tuple[str, bool]:
    """The column to read (``field``, else ``messages`` when only that one is there), checked
    to be one column, from the schema alone; and whether it holds text."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        schema = pq.ParquetFile(path).schema_arrow
    except Exception as exc:  # pyarrow raises many kinds for a damaged or foreign file
        raise PromptFileError(f"{path}: not a readable parquet file ({_one_line(exc)})") from None
    if field not in schema.names and CHAT_FIELD in schema.names:
        field = CHAT_FIELD
    if field not in schema.names:
        raise PromptFileError(
            f"{path}: no column {field!r} or {CHAT_FIELD!r} "
            f"(columns: {', '.join(map(str, schema.names))})"
        )
    if schema.names.count(field) > 1:
        try:  # pyarrow's own words for a name that matches several columns, as reading gives
            schema.empty_table().filter(pc.field(field).is_valid())
        except pa.ArrowInvalid as exc:
            raise PromptFileError(
                f"{path}: not a readable parquet file ({_one_line(exc)})"
            ) from None
        raise PromptFileError(f"{path}: {schema.names.count(field)} columns named {field!r}")
    kind = schema.field(field).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return field, pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _measured_chunks(file: Any, path: Path, field: str, max_rows: int, max_bytes: int) -> list:
    """The dictionary chunks of a text column, a row group at a time, refused as soon as the
    rows or their text's length (added up from the dictionary, no row's text copied) pass a
    cap."""
    import pyarrow as pa
    import pyarrow.compute as pc

    chunks = []
    read = measured = 0
    for group in range(file.num_row_groups):
        try:
            column = file.read_row_group(group, columns=[field]).column(0)
        except Exception as exc:
            raise PromptFileError(
                f"{path}: not a readable parquet file ({_one_line(exc)})"
            ) from None
        for chunk in column.chunks:
            # each row's length, taken from its dictionary entry: no row's text is copied
            try:
                lengths = pc.take(pc.binary_length(chunk.dictionary), chunk.indices)
            except pa.ArrowException as exc:  # a damaged file: indices past its dictionary
                raise PromptFileError(
                    f"{path}: not a readable parquet file ({_one_line(exc)})"
                ) from None
            measured += pc.sum(lengths).as_py() or 0
            read += len(chunk)
            chunks.append(chunk)
        if read > max_rows:  # metadata that does not match the data
            raise PromptFileError(
                f"{path}: at least {read} rows, more than data.max_rows_per_file={max_rows}{_RAISE}"
            )
        if measured > max_bytes:
            raise PromptFileError(
                f"{path}: the prompts of column {field!r} are at least {measured} bytes of text, "
                f"more than data.max_bytes_per_file={max_bytes}{_RAISE}"
            )
    return chunks


def _invalid_utf8(path: Path, field: str, chunk: Any, start: int) -> str:
    """The message for a dictionary chunk whose text is not valid UTF-8 (``start``: the row of
    its first value), naming the first row that holds a bad value."""
    bad = set()
    for position, value in enumerate(chunk.dictionary):
        try:
            value.as_py()
        except UnicodeDecodeError:
            bad.add(position)
    for row, index in enumerate(chunk.indices.to_pylist()):
        if index in bad:
            return f"{path}: row {start + row}: {field!r} is not valid UTF-8"
    return f"{path}: column {field!r} is not valid UTF-8"


def parquet_size(path: str | Path, field: str) -> tuple[int, int]:
    """Rows and the declared uncompressed bytes of a Parquet file's data, from its metadata:
    what :func:`load_prompts` compares with its caps before reading ``field``."""
    import pyarrow.parquet as pq

    return _metadata_size(pq.ParquetFile(path).metadata, field)


def _metadata_size(metadata: Any, field: str) -> tuple[int, int]:
    """Rows, and the uncompressed bytes of the file's data (every column, ``field``'s among
    them) summed over the row groups, as the file's metadata states them.

    Every column, not ``field``'s alone: pyarrow's per-column metadata accessor aborts the whole
    process (a C++ exception it does not catch) on some damaged files, e.g. a level histogram of
    the wrong size, while a row group's total is read without it. For a file of prompts alone
    the two are the same number.
    """
    del field  # kept in the signature: the callers name the column they will read
    groups = map(metadata.row_group, range(metadata.num_row_groups))
    return metadata.num_rows, sum(group.total_byte_size for group in groups)


def project_path(path: str | Path) -> str:
    """``path`` as a record (a manifest, a report) names it: as given when relative, relative
    to the working folder when it lies inside it, else its name alone. An absolute path would
    record the user's folders in files that are shared."""
    path = Path(path)
    if not path.is_absolute():
        return path.as_posix()
    try:  # both resolved: the working folder is reported with its links resolved
        return Path(os.path.realpath(path)).relative_to(os.path.realpath(os.getcwd())).as_posix()
    except ValueError:
        return path.name


def read_manifest_hash(prompt_file: str | Path) -> str | None:
    """The content hash of the data version, from ``manifest.json`` beside the prompt file."""
    manifest = Path(prompt_file).with_name(DATA_MANIFEST)
    if not manifest.is_file():
        return None
    try:
        return json.loads(manifest.read_text()).get("content_hash")
    except (json.JSONDecodeError, AttributeError):
        return None


def read_validation_record(prompt_file: str | Path) -> dict[str, Any] | None:
    """The settings ``ppo validate`` held the data version to (``validated_with.json`` beside
    the prompt file: ``max_tokens``, ``min_tokens``, ``data_hash``), or None where there is
    none (a prompt file this pipeline did not validate). A record that is not a small JSON
    object with an integer ``max_tokens`` is a :class:`PromptFileError` naming it."""
    path = Path(prompt_file).with_name(VALIDATION_RECORD)
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as stream:
            record = json.loads(stream.read(1 << 16))
    except (OSError, ValueError) as error:
        raise PromptFileError(f"{path}: not a validation record ({error})") from None
    if not isinstance(record, dict) or type(record.get("max_tokens")) is not int:
        raise PromptFileError(
            f"{path}: not a validation record (no integer max_tokens); run `ppo validate` again"
        )
    return record
