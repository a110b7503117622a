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


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"prompt": "a"}\n{"prompt": \n', r"p.jsonl:2: not valid JSON"),
        (b'{"prompt": "a"}\n["a"]\n', r"p.jsonl:2: expected a JSON object, got list"),
        (b'{"text": "a"}\n', r"p.jsonl:1: field 'prompt' is missing"),
        (b'{"prompt": 3}\n', r"p.jsonl:1: field 'prompt' is missing or not a non-empty string"),
        (b'{"prompt": "ok"}\n\xff\xfe\n', r"p.jsonl:2: not valid UTF-8"),
        (b"\n\n", r"p.jsonl: no prompts"),
    ],
)
def test_malformed_lines_are_named(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(PromptFileError, match=message):
        load_prompts(path)


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
    with pytest.raises(PromptFileError, match="r.jsonl:1"):
        load_prompts(tmp_path / "r.jsonl")
