"""Inputs that would grow without bound are refused early, naming the key or the file.

Configs: ``${...}`` may only refer to other keys (no resolver, the environment least of all), a
reference chain may not build a string longer than the limit, and sizes have upper bounds.
Prompt files: rows and bytes per file are capped, a Parquet file by its metadata before it is
read and by its text before that text is built (a dictionary-encoded column can expand a few
hundred bytes into gigabytes).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ppo_core.config import (
    MAX_VALUE_CHARS,
    UPPER_BOUNDS,
    Config,
    ConfigError,
    flatten,
    load_config,
)
from ppo_core.prompts import PromptFileError, load_prompts
from tests.helpers import examples

ROOT = Path(__file__).resolve().parents[2]
SECRET = "fuzz-secret-0123456789"
CAP_TAIL = "; split the file or raise the limit"


# ---- configs: references ------------------------------------------------------------------------

# String keys that no other check looks at (and none that may be null: a reference to null is not
# a string), so that whatever fails here fails for its references.
STRING_KEYS = [
    "model.reward",
    "data.raw_dir",
    "data.train_file",
    "data.eval_file",
    "data.prompt_field",
    "schedule.cron",
]
DEFAULTS = flatten(Config())
RESOLVERS = ["oc.env", "oc.decode", "oc.create", "oc.select", "oc.dict.keys", "oc.deprecated"]


@st.composite
def assignments(draw) -> dict[str, list[tuple[str, str, int]]]:
    """Values for some of STRING_KEYS made of text, repeated references to the keys set here (a
    default path could meet the checks of write paths) and, one piece in five, a resolver. Most
    values refer to keys set before them; one in ten may refer to any, so cycles occur too."""
    keys = draw(st.lists(st.sampled_from(STRING_KEYS), min_size=1, unique=True))
    values = {}
    for index, key in enumerate(keys):
        targets = keys[:index] if index and draw(st.integers(0, 9)) else keys
        text = st.text("abcxz_", min_size=1, max_size=6)
        piece = st.one_of(
            st.tuples(st.just("text"), text, st.integers(1, 3)),
            st.tuples(st.just("text"), text, st.integers(1, 3)),
            st.tuples(st.just("ref"), st.sampled_from(targets), st.integers(1, 12)),
            st.tuples(st.just("ref"), st.sampled_from(targets), st.integers(1, 12)),
            st.tuples(st.just("resolver"), st.sampled_from(RESOLVERS), st.just(1)),
        )
        values[key] = draw(st.lists(piece, min_size=1, max_size=4))
    return values


def render(parts: list[tuple[str, str, int]]) -> str:
    out = ""
    for kind, what, times in parts:
        if kind == "text":
            out += what * times
        elif kind == "ref":
            out += ("${" + what + "}") * times
        else:
            argument = "PPO_FUZZ_SECRET" if what == "oc.env" else "data.raw_dir"
            out += "${" + what + ":" + argument + "}"
    return out


def expected_strings(assigned: dict[str, list]) -> dict[str, str] | None:
    """What each set key resolves to, computed here by substitution; None when the config must be
    refused: a resolver anywhere, a reference cycle, or a value over the limit."""
    if any(kind == "resolver" for parts in assigned.values() for kind, _, _ in parts):
        return None
    lengths: dict[str, int] = {}

    def length(key: str, seen: tuple[str, ...]) -> int:
        if key in seen:
            raise RecursionError(key)
        if key not in assigned:
            return len(DEFAULTS[key])
        if key not in lengths:
            lengths[key] = sum(
                len(what) * times if kind == "text" else length(what, (*seen, key)) * times
                for kind, what, times in assigned[key]
            )
        return lengths[key]

    try:
        if any(length(key, ()) > MAX_VALUE_CHARS for key in assigned):
            return None
    except RecursionError:
        return None

    def value(key: str) -> str:
        if key not in assigned:
            return DEFAULTS[key]
        return "".join(
            what * times if kind == "text" else value(what) * times
            for kind, what, times in assigned[key]
        )

    return {key: value(key) for key in assigned}


def _get(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


@settings(
    max_examples=examples(200),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(assigned=assignments())
def test_fuzzed_references_resolve_exactly_or_are_refused_naming_a_key(assigned, monkeypatch):
    monkeypatch.setenv("PPO_FUZZ_SECRET", SECRET)
    overrides = [f"{key}={render(parts)}" for key, parts in assigned.items()]
    expected = expected_strings(assigned)
    try:
        config = load_config(overrides=overrides)
    except ConfigError as exc:
        message = str(exc)
        reason = "resolver" if "resolver" in message else "cycle" if "Recursive" in message else ""
        event(f"refused: {reason or 'too long'}")
        assert expected is None, f"{overrides} was refused: {message}"
        assert "\n" not in message and SECRET not in message and len(message) < 400, message
        named = re.match(
            r"config key '([^']+)': cannot resolve an \$\{\.\.\.\} reference: ", message
        )
        assert named and named.group(1) in assigned, message
        return
    event("loaded")
    assert expected is not None, f"{overrides} loaded"
    assert {key: _get(config, key) for key in assigned} == expected


def test_an_exponential_reference_chain_is_refused_at_once():
    """Six keys, each 40 references to the one before: the last would be 10 * 40**5 characters
    (1 GB); the first key over the limit is named."""
    overrides = ["model.reward=" + "x" * 10]
    for before, after in itertools.pairwise(STRING_KEYS):
        overrides.append(f"{after}=" + ("${" + before + "}") * 40)
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert str(info.value) == (
        "config key 'data.train_file': cannot resolve an ${...} reference: it would give a "
        "string of 16000 characters, over the limit of 4096"
    )


def test_the_environment_never_reaches_a_saved_config_or_a_message(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_FUZZ_SECRET", SECRET)
    path = tmp_path / "run.yaml"
    path.write_text(
        "seed: ${oc.env:PPO_FUZZ_SECRET}\nmodel:\n  policy: ${oc.env:PPO_FUZZ_SECRET}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert SECRET not in str(info.value) and "'oc.env'" in str(info.value)


# ---- configs: upper bounds ----------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(UPPER_BOUNDS))
@pytest.mark.parametrize("excess", [1, 1000, 10**18])
def test_every_bounded_key_names_itself_its_value_and_its_bound(key, excess):
    value = UPPER_BOUNDS[key] + excess
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"{key}={value}"])
    assert str(info.value) == f"{key} must be at most {UPPER_BOUNDS[key]}, got {value}"


# ---- prompt files ------------------------------------------------------------------------------


def parquet_of(column: pa.Array, row_group_size: int | None = None) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(
        pa.table({"prompt": column}), buffer, compression="zstd", row_group_size=row_group_size
    )
    return buffer.getvalue()


@st.composite
def parquet_files(draw) -> tuple[bytes, list[str]]:
    texts = draw(st.lists(st.text("abcdef ", min_size=1, max_size=400), min_size=1, max_size=8))
    rows = draw(st.integers(1, 300))
    indices = [draw(st.integers(0, len(texts) - 1)) for _ in range(min(rows, 20))]
    indices = (indices * (rows // len(indices) + 1))[:rows]
    prompts = [texts[i] for i in indices]
    if draw(st.booleans()):
        column = pa.DictionaryArray.from_arrays(pa.array(indices, type=pa.int32()), pa.array(texts))
    else:
        column = pa.array(prompts, type=draw(st.sampled_from([pa.string(), pa.large_string()])))
    return parquet_of(column, draw(st.sampled_from([None, 7, 64]))), prompts


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=parquet_files(),
    max_rows=st.one_of(st.integers(1, 300), st.just(1000)),
    max_bytes=st.one_of(st.integers(1, 5000), st.integers(5000, 60_000)),
)
def test_fuzzed_parquet_files_load_or_name_the_cap(tmp_path_factory, case, max_rows, max_bytes):
    """The metadata (rows, declared uncompressed size) and the text's length decide, in that
    order; under every cap a file gives exactly its prompts."""
    content, prompts = case
    path = tmp_path_factory.mktemp("parquet") / "p.parquet"
    path.write_bytes(content)
    metadata = pq.ParquetFile(path).metadata
    groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
    declared = sum(group.total_byte_size for group in groups)  # one column: the column's size
    # the text is measured a row group at a time and stops at the first one that crosses the cap
    text, start = 0, 0
    for group in groups:
        text += sum(len(p.encode()) for p in prompts[start : start + group.num_rows])
        start += group.num_rows
        if text > max_bytes:
            break
    try:
        loaded = load_prompts(path, allow_empty=True, max_rows=max_rows, max_bytes=max_bytes)
    except PromptFileError as exc:
        message = str(exc)
        if len(prompts) > max_rows:
            event("rows")
            expected = f"{path}: {len(prompts)} rows, more than data.max_rows_per_file={max_rows}"
        elif declared > max_bytes:
            event("declared bytes")
            expected = (
                f"{path}: its data is {declared} bytes uncompressed, more than "
                f"data.max_bytes_per_file={max_bytes}"
            )
        else:
            event("text bytes")
            assert text > max_bytes, message
            expected = (
                f"{path}: the prompts of column 'prompt' are at least {text} bytes of text, "
                f"more than "
                f"data.max_bytes_per_file={max_bytes}"
            )
        assert message == expected + CAP_TAIL
        return
    event("loaded")
    assert len(prompts) <= max_rows and declared <= max_bytes and text <= max_bytes
    assert loaded == prompts


@settings(max_examples=examples(200), deadline=None)
@given(
    lines=st.lists(st.sampled_from(["prompt", "blank", "empty"]), max_size=40),
    max_rows=st.integers(1, 40),
    max_bytes=st.integers(1, 2000),
)
def test_fuzzed_jsonl_files_load_or_name_the_cap(tmp_path_factory, lines, max_rows, max_bytes):
    path = tmp_path_factory.mktemp("jsonl") / "p.jsonl"
    text = {"prompt": '{"prompt": "a prompt"}\n', "blank": "\n", "empty": '{"prompt": " "}\n'}
    path.write_text("".join(text[kind] for kind in lines))
    size = path.stat().st_size
    rows = [number for number, kind in enumerate(lines, 1) if kind != "blank"]
    try:
        loaded = load_prompts(path, allow_empty=True, max_rows=max_rows, max_bytes=max_bytes)
    except PromptFileError as exc:
        if size > max_bytes:
            expected = f"{path}: {size} bytes, more than data.max_bytes_per_file={max_bytes}"
        else:
            expected = (
                f"{path}:{rows[max_rows]}: more than data.max_rows_per_file={max_rows} prompts"
            )
        assert str(exc) == expected + CAP_TAIL
        return
    assert size <= max_bytes and len(rows) <= max_rows
    assert len(loaded) == len(rows)


BOMB = """
import json, resource, sys
from pathlib import Path

import pyarrow.compute, pyarrow.parquet

from ppo_core.prompts import PromptFileError, load_prompts

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_prompts(Path(sys.argv[1]))
    outcome = "loaded"
except PromptFileError as exc:
    outcome = str(exc)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"outcome": outcome, "grew_kb": peak - before}))
"""


def test_a_tiny_parquet_file_that_expands_to_gigabytes_is_refused_in_little_memory(tmp_path):
    """The reported case: one string of 1 MB repeated 2300 times by a dictionary is a file of a
    few hundred bytes and 2.3 GB of text; with the default caps it is refused, and the process
    that reads it stays small (its peak memory, measured in a process of its own). Before the
    caps, reading it asked for 2.3 GB at once."""
    indices = pa.array([0] * 2300, type=pa.int32())
    path = tmp_path / "bomb.parquet"
    path.write_bytes(parquet_of(pa.DictionaryArray.from_arrays(indices, pa.array(["a" * 10**6]))))
    assert path.stat().st_size < 4096
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(BOMB), str(path)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=ROOT,
    )
    report = json.loads(result.stdout)
    assert report["outcome"] == (
        f"{path}: the prompts of column 'prompt' are at least 2300000000 bytes of text, more than "
        f"data.max_bytes_per_file={1 << 30}" + CAP_TAIL
    )
    # the peak memory grew by far less than the 2.3 GB the text would take (14 MB when measured)
    assert report["grew_kb"] < 100 * 1024, report
