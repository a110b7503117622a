"""Great Expectations validation of the prompt splits: each broken case names the right expectation."""

import json
import socket
import subprocess
import sys

import pandas as pd
import pytest

from flows.validation import DataValidationError, FailedExpectation, validate_prompt_splits

TRAIN = [f"The movie number {i} was" for i in range(40)]  # 5 whitespace tokens each
EVAL = [f"A film called {i} is" for i in range(10)]


def whitespace_tokens(texts):
    return [len(text.split()) for text in texts]


def validate(tmp_path, train=TRAIN, eval_=EVAL, **overrides):
    train = train if isinstance(train, pd.DataFrame) else pd.DataFrame({"prompt": train})
    eval_ = eval_ if isinstance(eval_, pd.DataFrame) else pd.DataFrame({"prompt": eval_})
    settings = dict(
        count_tokens=whitespace_tokens,
        min_tokens=1,
        max_tokens=8,
        min_train_rows=16,
        min_eval_rows=4,
        report_dir=tmp_path / "reports",
    )
    settings.update(overrides)
    return validate_prompt_splits(train, eval_, **settings)


def failures_by_name(result) -> dict[str, FailedExpectation]:
    assert not result.success
    names = [failure.expectation for failure in result.failures]
    assert len(names) == len(set(names)), names
    return {failure.expectation: failure for failure in result.failures}


def test_clean_data_passes_and_writes_reports_offline(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("validation tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    result = validate(tmp_path)
    assert result.success and result.failures == []
    # train: schema, type, not null, length, unique, row count; eval: the same plus leakage
    assert result.evaluated == 13
    assert result.docs_index == tmp_path / "reports" / "data_docs" / "index.html"
    assert result.docs_index.is_file()
    assert result.summary_path == tmp_path / "reports" / "summary.json"
    summary = json.loads(result.summary_path.read_text())
    assert summary["success"] is True and summary["evaluated"] == 13
    assert summary["splits"]["train"]["rows"] == 40
    assert summary["splits"]["eval"]["n_tokens"] == {"min": 5, "max": 5, "mean": 5.0}
    assert len(summary["splits"]["eval"]["expectations"]) == 7
    assert "passed" in result.describe()
    assert list(cwd.iterdir()) == []  # GE wrote nothing into the working directory
    # the report folder is outside the working folder: paths are relative to the report folder
    assert summary["docs_index"] == "data_docs/index.html"


def test_null_prompt(tmp_path):
    result = validate(tmp_path, train=[*TRAIN[:20], None, *TRAIN[20:]])
    failures = failures_by_name(result)
    null = failures["expect_column_values_to_not_be_null"]
    assert (null.split, null.column, null.unexpected_count) == ("train", "prompt", 1)
    assert null.examples == ["row 20: null"]
    # a null prompt has no length either: n_tokens is -1
    length = failures["expect_column_values_to_be_between"]
    assert (length.column, length.unexpected_count) == ("n_tokens", 1)
    assert set(failures) == {
        "expect_column_values_to_not_be_null",
        "expect_column_values_to_be_between",
    }
    # the reports exist when they matter most
    assert result.docs_index.is_file()
    assert json.loads(result.summary_path.read_text())["failed"] == 2


def test_duplicate_prompt(tmp_path):
    result = validate(tmp_path, eval_=[*EVAL, EVAL[3]])
    (failure,) = result.failures
    assert failure.expectation == "expect_column_values_to_be_unique"
    assert (failure.split, failure.column, failure.unexpected_count) == ("eval", "prompt", 2)
    assert failure.examples == ["row 3: 'A film called 3 is'", "row 10: 'A film called 3 is'"]


def test_too_long_prompt_shortens_its_example(tmp_path):
    long = "word " * 100
    result = validate(tmp_path, train=[*TRAIN, long])
    (failure,) = result.failures
    assert failure.expectation == "expect_column_values_to_be_between"
    assert (failure.split, failure.column, failure.unexpected_count) == ("train", "n_tokens", 1)
    (example,) = failure.examples
    assert example.startswith("row 40: 'word word") and example.endswith("... (100 tokens)")
    assert len(example) < 120
    assert "not 1..8 tokens long" in failure.details


def test_too_short_and_empty_prompts(tmp_path):
    result = validate(tmp_path, eval_=[*EVAL, "", "Hi"], min_tokens=2)
    (failure,) = result.failures
    assert failure.expectation == "expect_column_values_to_be_between"
    assert (failure.split, failure.unexpected_count) == ("eval", 2)
    assert failure.examples == ["row 10: '' (0 tokens)", "row 11: 'Hi' (1 tokens)"]


def test_eval_prompt_leaking_into_train(tmp_path):
    result = validate(tmp_path, eval_=[*EVAL, TRAIN[7]])
    (failure,) = result.failures
    assert failure.expectation == "expect_column_values_to_not_be_in_set"
    assert (failure.split, failure.column, failure.unexpected_count) == ("eval", "prompt", 1)
    assert failure.examples == ["row 10: 'The movie number 7 was'"]
    assert "leakage" in failure.details


def test_too_few_rows(tmp_path):
    result = validate(tmp_path, train=TRAIN[:3], min_eval_rows=11)
    assert [(f.expectation, f.split, f.column, f.unexpected_count) for f in result.failures] == [
        ("expect_table_row_count_to_be_between", "train", None, 0),
        ("expect_table_row_count_to_be_between", "eval", None, 0),
    ]
    assert [f.details for f in result.failures] == [
        "observed 3 rows, expected at least 16",
        "observed 10 rows, expected at least 11",
    ]


def test_extra_column(tmp_path):
    train = pd.DataFrame({"prompt": TRAIN, "label": 1})
    result = validate(tmp_path, train=train)
    (failure,) = result.failures
    assert failure.expectation == "expect_table_columns_to_match_set"
    assert (failure.split, failure.column, failure.unexpected_count) == ("train", None, 0)
    assert failure.examples == ["unexpected column 'label'"]


def test_input_column_named_like_the_derived_one_is_still_extra(tmp_path):
    train = pd.DataFrame({"prompt": TRAIN, "n_tokens": 5})
    (failure,) = validate(tmp_path, train=train).failures
    assert failure.expectation == "expect_table_columns_to_match_set"
    assert failure.examples == ["unexpected column 'n_tokens'"]


def test_non_string_prompt(tmp_path):
    result = validate(tmp_path, train=[*TRAIN, 42])
    failures = failures_by_name(result)
    wrong_type = failures["expect_column_values_to_be_of_type"]
    assert (wrong_type.split, wrong_type.unexpected_count, wrong_type.examples) == (
        "train",
        1,
        ["row 40: 42"],
    )


def test_missing_prompt_column_is_reported_not_raised(tmp_path):
    train = pd.DataFrame({"text": TRAIN})
    result = validate(tmp_path, train=train)
    failures = [f for f in result.failures if f.split == "train"]
    schema = next(f for f in failures if f.expectation == "expect_table_columns_to_match_set")
    assert "missing column 'prompt'" in schema.examples
    assert any(f.details.startswith("could not be evaluated") for f in failures)
    assert result.summary_path.is_file()


def test_error_message_names_failures_and_docs(tmp_path):
    # a second run into the same folder replaces the first one's reports
    validate(tmp_path)
    result = validate(tmp_path, eval_=[*EVAL, TRAIN[0]])
    message = str(DataValidationError(result))
    assert "[eval] expect_column_values_to_not_be_in_set on 'prompt', 1 row(s)" in message
    assert "'The movie number 0 was'" in message
    assert str(result.docs_index) in message
    assert json.loads(result.summary_path.read_text())["success"] is False
    pages = list((tmp_path / "reports" / "data_docs" / "validations").rglob("*.html"))
    assert len(pages) == 2  # this run's train and eval pages only


def test_reports_record_no_absolute_path(tmp_path, monkeypatch):
    """summary.json and the Data Docs are shared (DVC, CI artifacts): an absolute path would
    record the user's folders. Paths are recorded relative to the working folder."""
    project = tmp_path / "home" / "someone" / "project"
    project.mkdir(parents=True)
    monkeypatch.chdir(project)
    result = validate(tmp_path, eval_=[*EVAL, TRAIN[0]], report_dir=project / "reports")
    summary = json.loads(result.summary_path.read_text())
    assert summary["docs_index"] == "reports/data_docs/index.html"
    for path in (project / "reports").rglob("*"):
        if path.is_file() and path.suffix in (".json", ".html"):
            assert "someone" not in path.read_text(), path


def test_token_counter_must_return_one_count_per_text(tmp_path):
    with pytest.raises(ValueError, match=r"count_tokens returned 1 counts for 40 train prompts"):
        validate(tmp_path, count_tokens=lambda texts: [1])


def test_import_is_cheap():
    code = (
        "import sys, flows.validation; "
        "assert 'great_expectations' not in sys.modules and 'pandas' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prompt_text_reaches_the_data_docs_escaped_and_the_summary_as_it_is(tmp_path):
    """A tampered candidate version whose failing prompts are HTML (a duplicated ``<script>``, an
    eval prompt with an ``<img onerror>`` that is also a train prompt): the Data Docs show them
    as text, never as markup, and every outcome and example is what it is without escaping."""
    script = "<script>alert('docs')</script> was"
    image = '<img src=x onerror="alert(1)"> is'
    train = [*TRAIN[:-2], script, script, image]
    result = validate(tmp_path, train=train, eval_=[*EVAL[:-1], image])
    failed = {(f.expectation, f.split) for f in result.failures}
    assert failed == {
        ("expect_column_values_to_be_unique", "train"),
        ("expect_column_values_to_not_be_in_set", "eval"),
    }, result.failures
    examples = " ".join(e for f in result.failures for e in f.examples)
    assert "<script>alert('docs')</script>" in examples and "<img src=x" in examples
    pages = [p.read_text() for p in (tmp_path / "reports" / "data_docs").rglob("*.html")]
    assert any("alert(" in page for page in pages), "the failing values are not in the docs"
    for page in pages:
        assert "<script>alert(" not in page and "<img src=x" not in page
