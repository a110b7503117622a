import inspect
import json
import re

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppo_core.prompts import PromptFileError, load_prompts


def test_jsonl_and_parquet(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "extra": 1}\n')
    assert load_prompts(path) == ["a", "b"]
    pd.DataFrame({"prompt": ["x", "y"]}).to_parquet(tmp_path / "p.parquet")
    assert load_prompts(tmp_path / "p.parquet") == ["x", "y"]


FIELD = (
    "field 'prompt' is missing or not a non-empty string (a chat row has a 'messages' list instead)"
)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"prompt": "a"}\n{"prompt": \n', ":2: not valid JSON (Expecting value)"),
        (b'{"prompt": "a"}\n["a"]\n', ":2: expected a JSON object, got list"),
        (b'{"text": "a"}\n', f":1: {FIELD}"),
        (b'{"prompt": 3}\n', f":1: {FIELD}"),
        (
            b'{"prompt": "ok"}\n\n{"prompt": "ok"}\n\xff\xfe\n',
            ":4: not valid UTF-8 (invalid start byte)",
        ),
        (b"\n\n", ": no prompts"),
    ],
)
def test_malformed_lines_are_named(tmp_path, content, message):
    """The whole message: the file, the line number (blank lines count) and what is wrong."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(PromptFileError) as info:
        load_prompts(path)
    assert str(info.value) == f"{path}{message}"


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(PromptFileError, match="does not exist"):
        load_prompts(tmp_path / "none.jsonl")
    (tmp_path / "p.csv").write_text("prompt\na\n")
    with pytest.raises(PromptFileError, match="unknown prompt file type '.csv'"):
        load_prompts(tmp_path / "p.csv")
    pd.DataFrame({"text": ["x"]}).to_parquet(tmp_path / "q.parquet")
    with pytest.raises(PromptFileError, match="no column 'prompt'"):
        load_prompts(tmp_path / "q.parquet")
    (tmp_path / "r.jsonl").write_text(json.dumps({"prompt": "   "}) + "\n")
    with pytest.raises(PromptFileError) as info:
        load_prompts(tmp_path / "r.jsonl")
    assert str(info.value) == f"{tmp_path / 'r.jsonl'}:1: {FIELD}"
    assert load_prompts(tmp_path / "r.jsonl", allow_empty=True) == ["   "]  # prepare drops it


# ---- bounded reads: rows and bytes per file, measured before a file is read whole -------------


def write_jsonl(path, count):
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(count)))
    return path


def test_jsonl_rows_over_the_cap_are_refused_at_the_first_extra_row(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", 11)
    assert len(load_prompts(path, max_rows=11)) == 11
    with pytest.raises(PromptFileError) as info:
        load_prompts(path, max_rows=10)
    assert str(info.value) == (
        f"{path}:11: more than data.max_rows_per_file=10 prompts; split the file or raise the limit"
    )


def test_jsonl_bytes_over_the_cap_are_refused_before_reading(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "p.jsonl", 10)
    size = path.stat().st_size
    assert len(load_prompts(path, max_bytes=size)) == 10
    monkeypatch.setattr(type(path), "open", lambda *a, **k: pytest.fail("the file was opened"))
    with pytest.raises(PromptFileError) as info:
        load_prompts(path, max_bytes=size - 1)
    assert str(info.value) == (
        f"{path}: {size} bytes, more than data.max_bytes_per_file={size - 1}; "
        "split the file or raise the limit"
    )


def test_parquet_rows_over_the_cap_are_refused_from_the_metadata(tmp_path, monkeypatch):
    path = tmp_path / "p.parquet"
    pd.DataFrame({"prompt": [f"p{i}" for i in range(11)]}).to_parquet(path)
    assert len(load_prompts(path, max_rows=11)) == 11
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda *a, **k: pytest.fail("read"))
    with pytest.raises(PromptFileError) as info:
        load_prompts(path, max_rows=10)
    assert str(info.value) == (
        f"{path}: 11 rows, more than data.max_rows_per_file=10; split the file or raise the limit"
    )


def test_parquet_declared_size_over_the_cap_is_refused_from_the_metadata(tmp_path, monkeypatch):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["x" * 5000, "y" * 5000]}), path, compression="zstd")
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda *a, **k: pytest.fail("read"))
    with pytest.raises(PromptFileError) as info:
        load_prompts(path, max_bytes=9000)
    assert re.fullmatch(
        re.escape(f"{path}: its data is ")
        + r"\d+"
        + re.escape(
            " bytes uncompressed, more than data.max_bytes_per_file=9000; "
            "split the file or raise the limit"
        ),
        str(info.value),
    ), str(info.value)


def test_a_parquet_file_that_expands_is_refused_before_its_text_is_built(tmp_path):
    """One 100 kB string repeated by a dictionary: a file of a few hundred bytes, 200 MB of text."""
    path = tmp_path / "bomb.parquet"
    indices = pa.array([0] * 2000, type=pa.int32())
    column = pa.DictionaryArray.from_arrays(indices, pa.array(["a" * 100_000]))
    pq.write_table(pa.table({"prompt": column}), path, compression="zstd")
    assert path.stat().st_size < 2000
    with pytest.raises(PromptFileError) as info:
        load_prompts(path, max_bytes=10_000_000)
    assert str(info.value) == (
        f"{path}: the prompts of column 'prompt' are at least 200000000 bytes of text, more than "
        "data.max_bytes_per_file=10000000; split the file or raise the limit"
    )


def test_the_default_caps_are_the_config_defaults():
    from ppo_core.config import Config

    parameters = inspect.signature(load_prompts).parameters
    data = Config().data
    assert parameters["max_rows"].default == data.max_rows_per_file == 1_000_000
    assert parameters["max_bytes"].default == data.max_bytes_per_file == 1 << 30


# A three-row prompt file with one byte changed in its footer (found by the fuzz test): its
# level histogram has the wrong size. pyarrow's per-column metadata accessor then throws a C++
# exception it does not catch, and the process aborts.
ABORTING_PARQUET = (
    "UEFSMRUEFUAVQkwVBhUAEgAAIDAIAAAAYSByZXZpZXcLAQw4bm90aGVyIG9uZQEAAAB4FQAVFBUYLBUGFRAVBhUGHDYAKAF4"
    "GAhhIHJldmlldxERAAAACiQCAAAABgECAyQAFQQZLDUAGAZzY2hlbWEVAgAVDCV/GAZwcm9tcHQlAEwcAAAAFgYZHBkcJgAc"
    "FQwZNQAGEBkYBnByb21wdBUCFgYWuAEWvgEmZiYIHDYAKAF4GAhhIHJldmlldxERABksFQQVABUCABUAFRAVAgA8FigZBhkm"
    "AAYAAAAWuAEWBiYIFr4BADAcGAxBUlJPVzpzY2hlbWEYoAEvLy8vLzNBQUFBQVFBQUFBQUFBS0FBd0FCZ0FGQUFnQUNnbEFB"
    "QUFCQkFBTUFBQUFDQUFJQUFBQUJBQUlBQUFBQkFBQUFBRUFBQUFVQUFBQUVBQVVBQWdBQmdBSEFBd0FBQUFRQUKKQUFBQUFB"
    "QUVGRUFBQUFCd0FBQUFFQUFBQUFBQUFBQVlBQUFCd2NtOXRjSFFBQUFRQUJBQUVBQUFBABggcGFycXVldC1jcHAtYXJyb3cg"
    "dmVyc2lvbiAyNi4wLjEZHBwAAABhAQAAUEFSMQ=="
)


def test_a_parquet_footer_that_aborts_pyarrow_s_column_accessor_is_one_clear_error(tmp_path):
    import base64
    import subprocess
    import sys

    path = tmp_path / "damaged.parquet"
    path.write_bytes(base64.b64decode(ABORTING_PARQUET))
    # In a child process: before the fix this aborted the interpreter (SIGABRT), not the test.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from ppo_core.prompts import PromptFileError, load_prompts\n"
            "try:\n"
            "    load_prompts(sys.argv[1])\n"
            "except PromptFileError as exc:\n"
            "    print(exc)\n",
            str(path),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (
        f"{path}: not a readable parquet file (OSError: Definition level histogram size "
        "mismatch, size: 2, expected: 1)"
    )
