"""Great Expectations validation of preference pairs (the feedback data a reward model learns from).

A pair is a ``prompt`` (plain text, or a chat's canonical JSON text), the ``chosen`` reply and the
``rejected`` one; ``id`` and ``source`` may come with it. As in :mod:`flows.validation`, each split
(train, eval) is its own dataframe asset, expectation suite, validation definition and checkpoint
in an in-memory (ephemeral) GE context; the only things written are the Data Docs site
(``report_dir/data_docs/index.html``, its own site, cleared first) and ``report_dir/summary.json``.
GE is imported inside the function, so ``import flows.feedback_validation`` stays cheap.

The frame GE sees for a split is the input (the optional ``id``/``source`` added empty where absent,
so that one exact column-set expectation says "a subset of the allowed columns, with the required
ones") plus columns derived here:

* ``chosen_chars``, ``rejected_chars``: characters of the reply after stripping whitespace;
* ``chosen_tokens``, ``rejected_tokens``: tokens of prompt + reply as the reward model reads
  them (the caller's ``count_tokens``);
* ``same_reply``: whether the two replies are the same text (surrounding whitespace aside).

A derived number is -1 (``same_reply`` False) where a text is null or not a string, which the type
and null expectations report. A derived name the input already uses gets a free one (``_``
appended), so the input's column is still reported as unexpected.

Not a failure, but reported (``summary.json`` and `ValidationResult.describe`): how often the
chosen reply is the longer one. A reward model trained on pairs where it mostly is learns to
prefer length; ``describe()`` warns outside ``LENGTH_BIAS_LOW..LENGTH_BIAS_HIGH``.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.length_bias import LENGTH_BIAS_HIGH, LENGTH_BIAS_LOW, length_notes, measure_length_bias
from flows.validation import (
    FAILURE_FIELDS,
    SPLITS,
    DataValidationError,
    FailedExpectation,
    ValidationResult,
    fresh_context,
    recorded_path,
    string_values,
)
from flows.validation_results import (
    MAX_EXAMPLES,
    columns_details,
    exception_message,
    short_repr,
    token_stats,
)
from ppo_core.feedback.rows import mirrored_pairs
from ppo_core.files import atomic_write_text
from ppo_core.files.artifacts import VALIDATION_SUMMARY

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "DERIVED_COLUMNS",
    "DataValidationError",
    "ValidationResult",
    "validate_feedback_pairs",
]

DOCS_SITE = "feedback_validation"
TEXT_COLUMNS = ("prompt", "chosen", "rejected")  # required
OPTIONAL_COLUMNS = ("id", "source")
REPLIES = ("chosen", "rejected")
# Derived column -> the text column its examples show.
DERIVED_COLUMNS = {
    "chosen_chars": "chosen",
    "rejected_chars": "rejected",
    "chosen_tokens": "chosen",
    "rejected_tokens": "rejected",
    "same_reply": "chosen",
    "mirrored": "chosen",
}
# Outside these bounds on the share of pairs whose chosen reply is longer, describe() warns.
# summary.json's "validation": tells these reports from another validation's in the same folder.
_SUMMARY_KIND = "feedback_pairs"

CountTokens = Callable[[list[str], list[str]], list[int]]


def validate_feedback_pairs(
    train: pd.DataFrame,
    eval: pd.DataFrame,
    *,
    count_tokens: CountTokens,
    max_tokens: int,
    min_train_pairs: int,
    min_eval_pairs: int,
    report_dir: str | Path,
    max_mirrored_share: float = 0.0,
) -> ValidationResult:
    """Validate the train and eval preference pairs with Great Expectations; write Data Docs and a
    summary (with the chosen-longer share, a length bias a reward model would learn).

    Per split: the columns are ``prompt``, ``chosen``, ``rejected`` and optionally ``id``,
    ``source``; prompt and replies are non-null strings; neither reply is empty (after stripping
    whitespace); the two replies differ; each reply with its prompt is ``1..max_tokens`` tokens
    long (``count_tokens(prompts, replies)``, called once for the chosen and once for the
    rejected replies of a split, with the rows whose texts are strings); at least
    ``min_train_pairs`` / ``min_eval_pairs`` pairs; on eval, no prompt also a train prompt; at
    most ``max_mirrored_share`` of the pairs mirrored (the same prompt and replies, swapped, also
    in the split: feedback that contradicts itself, which a reward model cannot learn).
    Never raises on bad data: the result says what failed (raise `DataValidationError` with it).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    report_dir = Path(report_dir).resolve()
    _refuse_another_validations_folder(report_dir)
    docs_dir = report_dir / "data_docs"
    ge = fresh_context(docs_dir, site=DOCS_SITE, run_name="feedback_validation", prefix="pairs")
    frames = {"train": train, "eval": eval}
    min_pairs = {"train": min_train_pairs, "eval": min_eval_pairs}
    train_prompts = string_values(train["prompt"]) if "prompt" in train.columns else []
    split_reports: dict[str, dict[str, Any]] = {}
    lengths: list[tuple[pd.Series, pd.Series]] = []  # (chosen, rejected) tokens of each split
    for split in SPLITS:
        leak_set = [html.escape(p) for p in train_prompts] if split == "eval" else None
        split_reports[split], split_lengths = _check_split(
            ge,
            split,
            frames[split],
            count_tokens,
            (max_tokens, min_pairs[split], max_mirrored_share),
            leak_set,
        )
        lengths.append(split_lengths)

    checks = [check for report in split_reports.values() for check in report["expectations"]]
    failures = [
        FailedExpectation(**{k: check[k] for k in FAILURE_FIELDS})
        for check in checks
        if not check["success"]
    ]
    docs_index = docs_dir / "index.html"
    if not docs_index.is_file():
        raise RuntimeError(f"Great Expectations did not write its Data Docs index at {docs_index}")
    length_bias = measure_length_bias(lengths)
    result = ValidationResult(
        success=not failures,
        failures=failures,
        evaluated=len(checks),
        docs_index=docs_index,
        summary_path=report_dir / VALIDATION_SUMMARY,
        splits={split: report["rows"] for split, report in split_reports.items()},
        what="Feedback pair validation",
        data="feedback pairs",
        notes=length_notes(length_bias, split_reports),
    )
    settings = {
        "max_tokens": max_tokens,
        "min_train_pairs": min_train_pairs,
        "min_eval_pairs": min_eval_pairs,
        "required_columns": list(TEXT_COLUMNS),
        "optional_columns": list(OPTIONAL_COLUMNS),
        "length_bias_bounds": [LENGTH_BIAS_LOW, LENGTH_BIAS_HIGH],
    }
    _write_summary(result, settings, split_reports, length_bias, ge.gx.__version__)
    return result


def _check_split(
    ge: Any,
    split: str,
    pairs: pd.DataFrame,
    count_tokens: CountTokens,
    bounds: tuple[int, int, float],
    leak_set: list[str] | None,
) -> tuple[dict[str, Any], tuple[pd.Series, pd.Series]]:
    """One split's expectations run by Great Expectations: its report (rows, columns, token
    statistics, length bias, mirrored pairs, every check) and its chosen and rejected token
    lengths. ``bounds``: the most tokens, the fewest pairs, the largest mirrored share."""
    max_tokens, min_pairs, max_mirrored = bounds
    frame, names = _frame_for_ge(pairs, count_tokens, split)
    expectations = _expectations(
        ge.gx, names, (max_tokens, min_pairs, max_mirrored), leak_set=leak_set
    )
    # GE gets the texts HTML-escaped for the Data Docs (escaping is one-to-one, and every
    # length was counted from the texts themselves); the examples are read from the texts.
    checks = [
        _read_check(outcome, split, frame, names)
        for outcome in ge.check(split, expectations, _escaped(frame))
    ]
    lengths = (frame[names["chosen_tokens"]], frame[names["rejected_tokens"]])
    report = {
        "rows": len(frame),
        "columns": [str(c) for c in pairs.columns],
        "derived_columns": dict(names),
        "success": all(check["success"] for check in checks),
        "chosen_tokens": token_stats(frame[names["chosen_tokens"]]),
        "rejected_tokens": token_stats(frame[names["rejected_tokens"]]),
        "length_bias": measure_length_bias([lengths]),
        "mirrored_pairs": int(frame[names["mirrored"]].sum()),
        "expectations": checks,
    }
    return report, lengths


def _refuse_another_validations_folder(report_dir: Path) -> None:
    """Refuse a report folder that holds another validation's ``summary.json`` (the prompt
    splits'): its Data Docs and summary would be replaced by these and the next run of that one
    would replace these in turn. Give each validation its own folder (these go to a subfolder)."""
    summary_path = report_dir / VALIDATION_SUMMARY
    if not summary_path.is_file() or summary_path.is_symlink():
        return
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if (
        isinstance(summary, dict)
        and "great_expectations_version" in summary
        and summary.get("validation") != _SUMMARY_KIND
    ):
        raise ValueError(
            f"{report_dir} holds the reports of another validation ({summary_path}); "
            "give the feedback pair reports a folder of their own, e.g. a subfolder"
        )


def _write_summary(
    result: ValidationResult,
    settings: dict[str, Any],
    split_reports: dict[str, dict[str, Any]],
    length_bias: dict[str, Any],
    gx_version: str,
) -> None:
    """``summary.json``: the outcome, the settings, the length bias of both splits together, each
    split's report (with its own length bias) and every failure."""
    summary = {
        "validation": _SUMMARY_KIND,
        "success": result.success,
        "evaluated": result.evaluated,
        "failed": len(result.failures),
        "settings": settings,
        "length_bias": length_bias,
        "splits": split_reports,
        "failures": [asdict(failure) for failure in result.failures],
        "docs_index": recorded_path(result.docs_index, result.summary_path.parent),
        "great_expectations_version": gx_version,
    }
    atomic_write_text(result.summary_path, json.dumps(summary, indent=2, default=str) + "\n")


def _frame_for_ge(
    frame: pd.DataFrame, count_tokens: CountTokens, split: str
) -> tuple[pd.DataFrame, dict[str, str]]:
    """A copy of ``frame`` with the texts as objects, the optional columns it lacks added empty
    and the derived columns; the derived columns' names (``DERIVED_COLUMNS`` key -> name)."""
    import pandas as pd

    out = frame.reset_index(drop=True)
    taken = {str(column) for column in out.columns}
    names: dict[str, str] = {}
    for derived in DERIVED_COLUMNS:
        name = derived
        while name in taken:
            name += "_"
        names[derived] = name
        taken.add(name)
    for column in OPTIONAL_COLUMNS:
        if column not in out.columns:
            out[column] = pd.Series([None] * len(out), index=out.index, dtype=object)
    texts: dict[str, list[Any]] = {}
    for column in TEXT_COLUMNS:
        if column in out.columns:
            # object dtype: GE then checks the type of each value instead of the column's dtype.
            out[column] = out[column].astype(object)
            texts[column] = out[column].tolist()
        else:
            texts[column] = [None] * len(out)
    for reply in REPLIES:
        chars = [len(v.strip()) if isinstance(v, str) else -1 for v in texts[reply]]
        tokens = _token_counts(count_tokens, texts["prompt"], texts[reply], f"{split} {reply}")
        out[names[f"{reply}_chars"]] = pd.Series(chars, index=out.index, dtype="int64")
        out[names[f"{reply}_tokens"]] = pd.Series(tokens, index=out.index, dtype="int64")
    same = [
        isinstance(chosen, str) and isinstance(rejected, str) and chosen.strip() == rejected.strip()
        for chosen, rejected in zip(texts["chosen"], texts["rejected"], strict=True)
    ]
    out[names["same_reply"]] = pd.Series(same, index=out.index, dtype=bool)
    out[names["mirrored"]] = pd.Series(
        mirrored_pairs(texts["prompt"], texts["chosen"], texts["rejected"]),
        index=out.index,
        dtype=bool,
    )
    return out, names


def _token_counts(
    count_tokens: CountTokens, prompts: list[Any], replies: list[Any], what: str
) -> list[int]:
    """Tokens of each prompt + reply (one call for the rows where both are strings), -1 for the
    other rows."""
    rows = [
        i
        for i, (prompt, reply) in enumerate(zip(prompts, replies, strict=True))
        if isinstance(prompt, str) and isinstance(reply, str)
    ]
    counts = (
        list(count_tokens([prompts[i] for i in rows], [replies[i] for i in rows])) if rows else []
    )
    if len(counts) != len(rows):
        raise ValueError(
            f"count_tokens returned {len(counts)} counts for {len(rows)} {what} pairs; "
            "it must return one count per prompt and reply"
        )
    tokens = [-1] * len(prompts)
    for i, count in zip(rows, counts, strict=True):
        tokens[i] = int(count)
    return tokens


def _escaped(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every string prompt and reply HTML-escaped, other values as they are."""
    out = frame.copy()
    for column in TEXT_COLUMNS:
        if column in out.columns:
            out[column] = [html.escape(v) if isinstance(v, str) else v for v in frame[column]]
            out[column] = out[column].astype(object)
    return out


def _expectations(
    gx, names: dict[str, str], bounds: tuple[int, int, float], leak_set: list[str] | None
) -> list:
    """The suite of one split (``bounds``: the most tokens, the fewest pairs, the largest
    mirrored share; ``leak_set``: the train prompts, checked on eval only)."""
    max_tokens, min_pairs, max_mirrored = bounds
    e = gx.expectations
    derived = list(names.values())
    suite = [
        e.ExpectTableColumnsToMatchSet(
            column_set=[*TEXT_COLUMNS, *OPTIONAL_COLUMNS, *derived],
            exact_match=True,
            description=(
                "Columns are `prompt`, `chosen`, `rejected`, optionally `id` and `source` (added "
                "empty where absent) and the derived " + ", ".join(f"`{n}`" for n in derived)
            ),
        ),
        *(e.ExpectColumnValuesToBeOfType(column=column, type_="str") for column in TEXT_COLUMNS),
        *(e.ExpectColumnValuesToNotBeNull(column=column) for column in TEXT_COLUMNS),
    ]
    for reply in REPLIES:
        chars = names[f"{reply}_chars"]
        suite.append(
            e.ExpectColumnValuesToBeBetween(
                column=chars,
                min_value=1,
                max_value=None,
                description=(
                    f"The {reply} reply is not empty: `{chars}` (its characters after stripping "
                    "whitespace, -1 for a null or non-string reply) is at least 1"
                ),
            )
        )
    same = names["same_reply"]
    suite.append(
        e.ExpectColumnValuesToBeInSet(
            column=same,
            value_set=[False],
            description=(
                f"The chosen and rejected replies differ: `{same}` (the same text, surrounding "
                "whitespace aside) is False"
            ),
        )
    )
    suite.append(_mirrored_expectation(e, names["mirrored"], max_mirrored))
    for reply in REPLIES:
        tokens = names[f"{reply}_tokens"]
        suite.append(
            e.ExpectColumnValuesToBeBetween(
                column=tokens,
                min_value=1,
                max_value=max_tokens,
                description=(
                    f"The prompt with the {reply} reply is between 1 and {max_tokens} tokens "
                    f"long as the reward model reads it (`{tokens}`, -1 where a text is null or "
                    "not a string)"
                ),
            )
        )
    suite.append(e.ExpectTableRowCountToBeBetween(min_value=min_pairs, max_value=None))
    if leak_set is not None:
        # The description keeps the docs from listing every train prompt.
        suite.append(
            e.ExpectColumnValuesToNotBeInSet(
                column="prompt",
                value_set=leak_set,
                description=f"No eval prompt is one of the {len(leak_set)} train prompts",
            )
        )
    return suite


def _mirrored_expectation(e, column: str, max_share: float):
    return e.ExpectColumnValuesToBeInSet(
        column=column,
        value_set=[False],
        mostly=1.0 - max_share,
        description=(
            f"At most {max_share:.0%} of the pairs are mirrored (`{column}`: the same prompt and "
            "replies, swapped, are also a pair; validation.max_mirrored_share)"
        ),
    )


def _read_check(
    outcome: dict[str, Any], split: str, frame: pd.DataFrame, names: dict[str, str]
) -> dict[str, Any]:
    """One expectation's GE result (its JSON form) as a flat record for the summary."""
    config = outcome["expectation_config"]
    kind = config["type"]
    kwargs = config["kwargs"]
    column = kwargs.get("column")
    details = outcome.get("result") or {}
    error = exception_message(outcome.get("exception_info") or {})
    examples: list[str]
    if error is not None:
        text, examples = f"could not be evaluated: {error}", []
    elif kind == "expect_table_columns_to_match_set":
        text, examples = columns_details(details, kwargs["column_set"])
    elif kind == "expect_table_row_count_to_be_between":
        text = f"observed {details.get('observed_value')} pairs, expected at least {kwargs['min_value']}"
        examples = []
    else:
        role = {name: derived for derived, name in names.items()}.get(column, column)
        text = _column_details(kind, role, column, details, kwargs)
        examples = _examples(details, frame, role, column)
    return {
        "expectation": kind,
        "split": split,
        "column": column,
        "success": bool(outcome["success"]),
        "unexpected_count": int(details.get("unexpected_count") or 0),
        "examples": [] if outcome["success"] else examples,
        "details": text,
    }


def _column_details(
    kind: str, role: str, column: str, details: dict[str, Any], kwargs: dict[str, Any]
) -> str:
    """One line: how many rows broke the expectation on ``column`` (whose part is ``role``)."""
    count = int(details.get("unexpected_count") or 0)
    rows = details.get("element_count")
    reply = DERIVED_COLUMNS.get(role, role)
    if kind == "expect_column_values_to_be_of_type":
        return f"{count} of {rows} {column} values are not strings"
    if kind == "expect_column_values_to_not_be_null":
        return f"{count} of {rows} {column} values are null"
    if kind == "expect_column_values_to_be_between" and role.endswith("_chars"):
        return f"{count} of {rows} {reply} replies are empty or not strings ({column} < 1)"
    if kind == "expect_column_values_to_be_between" and role.endswith("_tokens"):
        return (
            f"{count} of {rows} pairs have a {reply} reply whose prompt + reply is not "
            f"1..{int(kwargs['max_value'])} tokens long ({column})"
        )
    if kind == "expect_column_values_to_be_in_set" and role == "same_reply":
        return f"{count} of {rows} pairs have the same chosen and rejected reply ({column})"
    if kind == "expect_column_values_to_be_in_set" and role == "mirrored":
        allowed = 1.0 - float(kwargs.get("mostly", 1.0))
        return (
            f"{count} of {rows} pairs are mirrored (the same prompt and replies, swapped, are "
            f"also a pair), more than the share {allowed:.2g} allowed ({column}; "
            "validation.max_mirrored_share)"
        )
    if kind == "expect_column_values_to_not_be_in_set":
        return f"{count} of {rows} eval prompts also appear in train (leakage)"
    return f"{count} of {rows} values unexpected"


def _examples(details: dict[str, Any], frame: pd.DataFrame, role: str, column: str) -> list[str]:
    """Up to three offending rows, as ``row <i>: <repr of the text>``: the checked text, or the
    reply a derived column was computed from (plus its token count)."""
    indices = details.get("partial_unexpected_index_list") or []
    values = details.get("partial_unexpected_list") or []
    text_column = DERIVED_COLUMNS.get(role, role)
    examples: list[str] = []
    for position, value in enumerate(values[: len(indices) or None]):
        row = int(indices[position]) if indices else None
        if row is not None and text_column in frame.columns and 0 <= row < len(frame):
            shown = frame.at[row, text_column]
        else:
            shown = html.unescape(value) if isinstance(value, str) else value
        text = short_repr(shown)
        if role.endswith("_tokens") and row is not None and 0 <= row < len(frame):
            n_tokens = int(frame.at[row, column])
            text += f" ({n_tokens} tokens)" if n_tokens >= 0 else " (not counted)"
        examples.append(f"row {row}: {text}" if row is not None else text)
        if len(examples) == MAX_EXAMPLES:
            break
    return examples
