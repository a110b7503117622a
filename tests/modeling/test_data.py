import json

import pandas as pd
import pytest

from ppo_core.modeling.data import PromptFileError, load_prompts


def test_jsonl_and_parquet(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "extra": 1}\n')
    assert load_prompts(path) == ["a", "b"]
    pd.DataFrame({"prompt": ["x", "y"]}).to_parquet(tmp_path / "p.parquet")
    assert load_prompts(tmp_path / "p.parquet") == ["x", "y"]


FIELD = "field 'prompt' is missing or not a non-empty string"


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
