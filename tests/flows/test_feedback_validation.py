"""Great Expectations validation of preference pairs: each broken case names the right expectation,
and the length bias (how often the chosen reply is the longer one) is reported."""

import json
import socket
import subprocess
import sys

import pandas as pd
import pytest

from flows.feedback_validation import validate_feedback_pairs
from flows.validation import DataValidationError, validate_prompt_splits

# Whitespace tokens: every prompt is 4, "Yes" 1, "It is" / "Not so" 2, "No it is not" 4,
# "It is a good one" 5, "Maybe" 1.
SHORTER, TIE, LONGER = ("Yes", "No it is not"), ("It is", "Not so"), ("It is a good one", "Maybe")
# train: per 4 pairs one chosen shorter, one tie, two chosen longer -> 20 of 40 longer, 10 ties
TRAIN_KINDS = [[SHORTER, TIE, LONGER, LONGER][i % 4] for i in range(40)]
# eval: chosen longer and shorter in turn -> 5 of 10 longer, no tie
EVAL_KINDS = [[LONGER, SHORTER][i % 2] for i in range(10)]


def pairs(prompt: str, kinds) -> dict[str, list]:
    return {
        "prompt": [prompt.format(i) for i in range(len(kinds))],
        "chosen": [chosen for chosen, _ in kinds],
        "rejected": [rejected for _, rejected in kinds],
    }


def train_pairs(kinds=TRAIN_KINDS):
    return pairs("Question number {} is", kinds)


def eval_pairs(kinds=EVAL_KINDS):
    return pairs("Another question {} here", kinds)


def whitespace_tokens(prompts, responses):
    return [len(p.split()) + len(r.split()) for p, r in zip(prompts, responses, strict=True)]


def validate(tmp_path, train=None, eval_=None, **overrides):
    train = pd.DataFrame(train_pairs() if train is None else train)
    eval_ = pd.DataFrame(eval_pairs() if eval_ is None else eval_)
    settings = dict(
        count_tokens=whitespace_tokens,
        max_tokens=12,
        min_train_pairs=16,
        min_eval_pairs=4,
        report_dir=tmp_path / "reports" / "feedback",
    )
    settings.update(overrides)
    return validate_feedback_pairs(train, eval_, **settings)


def failed(result) -> set[tuple[str, str, str | None]]:
    assert not result.success
    return {(f.split, f.expectation, f.column) for f in result.failures}


def test_good_pairs_pass_and_report_the_length_bias(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("validation tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    calls = []

    def counting(prompts, responses):
        calls.append(len(prompts))
        return whitespace_tokens(prompts, responses)

    train = train_pairs()
    train["id"] = [f"t{i}" for i in range(40)]
    train["source"] = [None if i % 3 else "web" for i in range(40)]  # optional, str or None
    result = validate(tmp_path, train=train, count_tokens=counting)
    assert result.success and result.failures == [], result.describe()
    assert calls == [40, 40, 10, 10]  # once for chosen and once for rejected per split
    # schema, 3 types, 3 not null, 2 not empty, replies differ, mirrored, 2 token lengths,
    # pairs; eval: leak
    assert result.evaluated == 14 + 15
    reports = tmp_path / "reports" / "feedback"
    assert result.docs_index == reports / "data_docs" / "index.html"
    assert result.docs_index.is_file()
    assert result.summary_path == reports / "summary.json"
    summary = json.loads(result.summary_path.read_text())
    assert summary["success"] is True and summary["failed"] == 0
    assert summary["docs_index"] == "data_docs/index.html"
    assert summary["settings"]["max_tokens"] == 12
    assert summary["settings"]["min_train_pairs"] == 16
    # hand-computed: train 20 of 40 chosen longer, 10 ties; eval 5 of 10, no tie; tokens with
    # the prompt (4): train chosen (10*5 + 10*6 + 20*9) / 40, rejected (10*8 + 10*6 + 20*5) / 40
    assert summary["splits"]["train"]["length_bias"] == {
        "pairs": 40,
        "chosen_longer_share": 0.5,
        "ties_share": 0.25,
        "chosen_mean_tokens": 7.25,
        "rejected_mean_tokens": 6.0,
        "warning": None,
    }
    assert summary["splits"]["eval"]["length_bias"]["chosen_longer_share"] == 0.5
    assert summary["splits"]["eval"]["length_bias"]["ties_share"] == 0.0
    assert summary["length_bias"] == {
        "pairs": 50,
        "chosen_longer_share": 0.5,
        "ties_share": 0.2,
        "chosen_mean_tokens": 7.2,  # (290 + 70) / 50
        "rejected_mean_tokens": 6.1,  # (240 + 65) / 50
        "warning": None,
    }
    assert summary["splits"]["eval"]["rejected_tokens"] == {"min": 5, "max": 8, "mean": 6.5}
    assert summary["splits"]["train"]["columns"] == ["prompt", "chosen", "rejected", "id", "source"]
    assert len(summary["splits"]["eval"]["expectations"]) == 15
    described = result.describe()
    assert described.startswith("Feedback pair validation passed: 29 expectations")
    assert "chosen reply has more tokens than the rejected one in 50.0% of 50 pairs" in described
    assert "Warning" not in described
    assert list(cwd.iterdir()) == []  # GE wrote nothing into the working directory


@pytest.mark.parametrize(
    ("train_kinds", "share", "prefers"),
    [
        # every chosen reply longer: 50 of 50
        ([LONGER] * 40, 1.0, "longer"),
        # chosen and rejected swapped: train 10 of 40 longer, eval 5 of 10
        ([(r, c) for c, r in TRAIN_KINDS], 0.3, "shorter"),
    ],
)
def test_a_length_bias_is_reported_with_a_warning_not_a_failure(
    tmp_path, train_kinds, share, prefers
):
    eval_kinds = [LONGER] * 10 if prefers == "longer" else [(r, c) for c, r in EVAL_KINDS]
    result = validate(tmp_path, train=train_pairs(train_kinds), eval_=eval_pairs(eval_kinds))
    assert result.success
    summary = json.loads(result.summary_path.read_text())
    assert summary["length_bias"]["chosen_longer_share"] == share
    assert f"may learn to prefer {prefers} replies" in summary["length_bias"]["warning"]
    assert f"Warning: the chosen reply is the longer one in {'only ' * (share < 0.5)}" in (
        result.describe()
    )
    assert f"{share:.1%} of 50 pairs" in result.describe()


def _set(frame: dict[str, list], column: str, row: int, value) -> dict[str, list]:
    frame[column][row] = value
    return frame


LONG = "word " * 20  # 20 tokens, 24 with its prompt


@pytest.mark.parametrize(
    ("train", "eval_", "split", "named", "examples", "also"),
    [
        pytest.param(
            _set(train_pairs(), "chosen", 5, "   "),
            None,
            "train",
            ("expect_column_values_to_be_between", "chosen_chars", 1),
            ["row 5: '   '"],
            set(),
            id="empty chosen",
        ),
        pytest.param(
            None,
            _set(eval_pairs(), "rejected", 2, " " + LONGER[0]),
            "eval",
            ("expect_column_values_to_be_in_set", "same_reply", 1),
            ["row 2: 'It is a good one'"],
            set(),
            id="identical chosen and rejected",
        ),
        pytest.param(
            _set(train_pairs(), "rejected", 7, LONG),
            None,
            "train",
            ("expect_column_values_to_be_between", "rejected_tokens", 1),
            [f"row 7: {repr(LONG)[:77]}... (24 tokens)"],  # shortened to 80 characters,
            set(),
            id="too long reply",
        ),
        pytest.param(
            None,
            _set(eval_pairs(), "prompt", 3, "Question number 7 is"),
            "eval",
            ("expect_column_values_to_not_be_in_set", "prompt", 1),
            ["row 3: 'Question number 7 is'"],
            set(),
            id="prompt in both splits",
        ),
        pytest.param(
            _set(train_pairs(), "chosen", 9, 42),
            None,
            "train",
            ("expect_column_values_to_be_of_type", "chosen", 1),
            ["row 9: 42"],
            # no length for a value that is not a string: both derived columns are -1
            {
                ("expect_column_values_to_be_between", "chosen_chars"),
                ("expect_column_values_to_be_between", "chosen_tokens"),
            },
            id="non-string reply",
        ),
        pytest.param(
            None,
            _set(eval_pairs(), "prompt", 4, None),
            "eval",
            ("expect_column_values_to_not_be_null", "prompt", 1),
            ["row 4: null"],
            {
                ("expect_column_values_to_be_between", "chosen_tokens"),
                ("expect_column_values_to_be_between", "rejected_tokens"),
            },
            id="null prompt",
        ),
    ],
)
def test_a_broken_pair_fails_with_its_expectation_named(
    tmp_path, train, eval_, split, named, examples, also
):
    result = validate(tmp_path, train=train, eval_=eval_)
    expectation, column, count = named
    assert failed(result) == {(split, expectation, column)} | {(split, *e) for e in also}
    failure = next(f for f in result.failures if f.expectation == expectation)
    assert (failure.column, failure.unexpected_count, failure.examples) == (column, count, examples)
    described = result.describe()
    assert described.startswith("Feedback pair validation failed:")
    assert f"[{split}] {expectation} on '{column}', {count} row(s): " in described
    assert json.loads(result.summary_path.read_text())["failed"] == len(result.failures)


def test_too_few_pairs(tmp_path):
    train = train_pairs(TRAIN_KINDS[:8])
    result = validate(tmp_path, train=train, min_eval_pairs=11)
    assert [(f.expectation, f.split, f.column) for f in result.failures] == [
        ("expect_table_row_count_to_be_between", "train", None),
        ("expect_table_row_count_to_be_between", "eval", None),
    ]
    described = result.describe()
    assert (
        "[train] expect_table_row_count_to_be_between: observed 8 pairs, expected at least 16"
        in (described)
    )
    assert (
        "[eval] expect_table_row_count_to_be_between: observed 10 pairs, expected at least 11"
        in (described)
    )


def test_mirrored_pairs_fail_past_their_share_and_are_counted(tmp_path):
    """The train pairs and their 40 swapped copies: every one of the 80 is mirrored, past the
    default share of 5 %; allowed with max_mirrored_share=1. Two mirrored of 41 (4.9 %) pass
    at 5 % and are counted in the summary. Seen failing without the expectation (the 80 passed)."""
    train = train_pairs()
    swapped = {"prompt": train["prompt"], "chosen": train["rejected"], "rejected": train["chosen"]}
    # the tie pairs ("It is" / "Not so") swapped are still different replies: mirrored too
    both = {key: train[key] + swapped[key] for key in train}
    result = validate(tmp_path / "a", train=both, max_mirrored_share=0.05)
    assert ("train", "expect_column_values_to_be_in_set", "mirrored") in failed(result)
    assert "80 of 80 pairs are mirrored" in result.describe()
    allowed = validate(tmp_path / "b", train=both, max_mirrored_share=1.0)
    assert allowed.success
    few = {key: train[key] + swapped[key][:1] for key in train}  # the first pair mirrored
    one = validate(tmp_path / "c", train=few, max_mirrored_share=0.05)
    assert one.success, one.describe()
    summary = json.loads((tmp_path / "c" / "reports" / "feedback" / "summary.json").read_text())
    assert summary["splits"]["train"]["mirrored_pairs"] == 2


@pytest.mark.parametrize(
    ("change", "example"),
    [
        pytest.param({"drop": "rejected"}, "missing column 'rejected'", id="missing column"),
        pytest.param({"add": "label"}, "unexpected column 'label'", id="extra column"),
        # an input column named like a derived one is still reported, not overwritten
        pytest.param({"add": "same_reply"}, "unexpected column 'same_reply'", id="derived name"),
    ],
)
def test_columns_are_the_pair_columns_and_the_derived_ones(tmp_path, change, example):
    eval_ = eval_pairs()
    if "drop" in change:
        del eval_[change["drop"]]
    else:
        eval_[change["add"]] = [False] * 10
    result = validate(tmp_path, eval_=eval_)
    failures = {(f.split, f.expectation): f for f in result.failures}
    schema = failures[("eval", "expect_table_columns_to_match_set")]
    assert example in schema.examples
    assert "[eval] expect_table_columns_to_match_set: observed columns" in result.describe()
    if "drop" in change:  # what needs the missing column cannot be evaluated: reported, not raised
        assert any(f.details.startswith("could not be evaluated") for f in result.failures)
    else:
        assert list(failures) == [("eval", "expect_table_columns_to_match_set")]


def test_prompt_and_feedback_sites_coexist(tmp_path):
    """The stage passes report_dir=reports/validation/feedback beside the prompt validation's
    reports/validation: rebuilding either site leaves the other one's pages in place."""
    validation = tmp_path / "validation"
    prompts = pd.DataFrame({"prompt": [f"The movie number {i} was" for i in range(20)]})
    prompt_settings = dict(
        count_tokens=lambda texts: [len(t.split()) for t in texts],
        min_tokens=1,
        max_tokens=8,
        min_train_rows=4,
        min_eval_rows=4,
        report_dir=validation,
    )
    assert validate_prompt_splits(prompts[:16], prompts[16:], **prompt_settings).success
    feedback = validate(tmp_path, report_dir=validation / "feedback")
    assert feedback.success
    assert validate_prompt_splits(prompts[:16], prompts[16:], **prompt_settings).success
    assert feedback.docs_index.is_file() and feedback.summary_path.is_file()
    assert len(list((validation / "feedback" / "data_docs" / "validations").rglob("*.html"))) == 2
    again = validate(tmp_path, report_dir=validation / "feedback")
    assert again.success
    assert len(list((validation / "data_docs" / "validations").rglob("*.html"))) == 2
    assert json.loads((validation / "summary.json").read_text())["settings"]["min_tokens"] == 1
    # the prompt validation's own folder is refused, before anything in it is cleared
    with pytest.raises(ValueError, match="holds the reports of another validation"):
        validate(tmp_path, report_dir=validation)
    assert (validation / "data_docs" / "index.html").is_file()


def test_texts_reach_the_data_docs_escaped_and_the_summary_as_they_are(tmp_path):
    image = '<img src=x onerror="alert(1)"> is'
    train = _set(train_pairs(), "prompt", 3, image)
    result = validate(tmp_path, train=train, eval_=_set(eval_pairs(), "prompt", 0, image))
    (failure,) = result.failures
    assert failure.expectation == "expect_column_values_to_not_be_in_set"
    assert failure.examples == [f"row 0: {image!r}"]
    pages = [p.read_text() for p in (tmp_path / "reports" / "feedback").rglob("*.html")]
    assert any("alert(" in page for page in pages), "the failing values are not in the docs"
    assert not any("<img src=x" in page for page in pages)


def test_error_message_names_the_feedback_pairs(tmp_path):
    result = validate(tmp_path, train=_set(train_pairs(), "chosen", 0, ""))
    message = str(DataValidationError(result))
    assert message.startswith("Feedback pair validation failed: 1 of 29 expectations")
    assert "Fix the feedback pairs" in message and str(result.docs_index) in message


def test_token_counter_must_return_one_count_per_pair(tmp_path):
    with pytest.raises(ValueError, match=r"returned 1 counts for 40 train chosen pairs"):
        validate(tmp_path, count_tokens=lambda prompts, responses: [1])


def test_import_is_cheap():
    code = (
        "import sys, flows.feedback_validation; "
        "assert 'great_expectations' not in sys.modules and 'pandas' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
