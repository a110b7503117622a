"""Reference fields read beside the prompts: JSONL keys, raw Parquet text columns, a prepared
split's ``references`` column; a missing, null or oversized field, or a field named like the
prompt's own column, is one error naming the file, the line (or row) and the field."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ppo_core.prompts import MAX_LINE_BYTES, PromptFileError, load_prompts
from ppo_core.references import (
    batch_references,
    check_reference_fields,
    load_references,
    reference_json,
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_jsonl_rows_carry_any_json_value_and_line_up_with_their_prompts(tmp_path):
    rows = [
        {"prompt": "2 + 2 =", "answer": "4", "tests": ["assert f() == 4"]},
        {"messages": [{"role": "user", "content": "3 + 4?"}], "answer": 7, "tests": []},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")  # a blank line
    assert len(load_prompts(path)) == 2
    references = load_references(path, ["answer", "tests"])
    assert references == [
        {"answer": "4", "tests": ["assert f() == 4"]},
        {"answer": 7, "tests": []},
    ]
    assert batch_references(references, ["answer"]) == {"answer": ["4", 7]}
    assert batch_references(references, []) is None
    assert load_references(path, []) == []


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"prompt": "p"}, "reference field 'answer' is missing"),
        ({"prompt": "p", "answer": None}, "reference field 'answer' is missing"),
        ({"prompt": "p", "answer": ["x" * 300_000] * 4}, "line longer than the limit"),
    ],
)
def test_a_bad_reference_names_the_file_line_and_field(tmp_path, row, problem):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "answer": "1"}, row])
    with pytest.raises(PromptFileError, match=rf"p\.jsonl:2: {problem}"):
        load_references(path, ["answer"])


def test_parquet_raw_columns_and_prepared_json_column(tmp_path):
    raw = tmp_path / "raw.parquet"
    pd.DataFrame({"prompt": ["a", "b"], "answer": ["1", None]}).to_parquet(raw)
    with pytest.raises(PromptFileError, match=r"raw\.parquet: row 1: reference field 'answer'"):
        load_references(raw, ["answer"])
    numbers = tmp_path / "numbers.parquet"
    pd.DataFrame({"prompt": ["a"], "answer": [1]}).to_parquet(numbers)
    with pytest.raises(PromptFileError, match=r"column 'answer' does not hold text"):
        load_references(numbers, ["answer"])
    with pytest.raises(PromptFileError, match=r"no column for the reference field 'tests'"):
        load_references(raw, ["tests"])
    huge = tmp_path / "huge.parquet"
    pd.DataFrame({"prompt": ["a"], "answer": ["x" * (MAX_LINE_BYTES + 1)]}).to_parquet(huge)
    with pytest.raises(PromptFileError, match=r"row 0: reference field 'answer' is 10485\d+ bytes"):
        load_references(huge, ["answer"])
    prepared = tmp_path / "train.parquet"
    pd.DataFrame(
        {"prompt": ["a", "b"], "references": [reference_json({"answer": 1}), "[1]"]}
    ).to_parquet(prepared)
    with pytest.raises(PromptFileError, match=r"row 1: 'references' is not the JSON of an object"):
        load_references(prepared, ["answer"])


def test_reference_fields_that_name_the_prompts_own_columns_are_refused():
    check_reference_fields(["answer", "tests"], "prompt")
    for fields, problem in (
        (["prompt"], "'prompt', which names the prompt's own column"),
        (["messages"], "'messages', which names"),
        (["answer", "answer"], "names a field twice"),
        ([""], "not a field name"),
    ):
        with pytest.raises(PromptFileError, match=problem):
            check_reference_fields(fields, "prompt")
