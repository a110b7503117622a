"""Great Expectations' results read back (the `validate` stage's report): each expectation's
outcome as one line a person can act on, with a few failing values shown, and the token-length
statistics of a split."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

EXAMPLE_CHARS = 80
MAX_EXAMPLES = 3


def read_result(
    result: dict[str, Any],
    split: str,
    frame: pd.DataFrame,
    prompt_field: str,
    tokens_column: str,
) -> dict[str, Any]:
    """One expectation's GE result (its JSON form) as a flat record for the summary."""
    config = result["expectation_config"]
    kind = config["type"]
    kwargs = config["kwargs"]
    column = kwargs.get("column")
    details = result.get("result") or {}
    unexpected = int(details.get("unexpected_count") or 0)
    error = exception_message(result.get("exception_info") or {})
    examples: list[Any]
    if error is not None:
        text, examples = f"could not be evaluated: {error}", []
    elif kind == "expect_table_columns_to_match_set":
        text, examples = columns_details(details, kwargs["column_set"])
    elif kind == "expect_table_row_count_to_be_between":
        text = f"observed {details.get('observed_value')} rows, expected at least {kwargs['min_value']}"
        examples = []
    else:
        text = _column_details(kind, details, kwargs, tokens_column)
        examples = _examples(details, frame, prompt_field, tokens_column, column)
    return {
        "expectation": kind,
        "split": split,
        "column": column,
        "success": bool(result["success"]),
        "unexpected_count": unexpected,
        "examples": [] if result["success"] else examples,
        "details": text,
    }


def exception_message(info: dict[str, Any]) -> str | None:
    """The first line of the error GE caught while evaluating an expectation, if any."""
    # Either {"raised_exception": ..., "exception_message": ...} or, when a metric failed,
    # {<metric id>: {"exception_message": ...}}.
    if "raised_exception" in info:
        entries = [info] if info["raised_exception"] else []
    else:
        entries = [entry for entry in info.values() if isinstance(entry, dict)]
    for entry in entries:
        message = str(entry.get("exception_message") or "").strip()
        return message.splitlines()[0] if message else "unknown error"
    return None


def columns_details(details: dict[str, Any], expected: list[str]) -> tuple[str, list[str]]:
    """The observed columns against the expected ones; the unexpected and missing ones."""
    observed = details.get("observed_value")
    mismatch = (details.get("details") or {}).get("mismatched") or {}
    examples = [f"unexpected column {name!r}" for name in mismatch.get("unexpected", [])]
    examples += [f"missing column {name!r}" for name in mismatch.get("missing", [])]
    return f"observed columns {observed}, expected exactly {sorted(expected)}", examples[
        :MAX_EXAMPLES
    ]


def _column_details(kind: str, details: dict[str, Any], kwargs: dict[str, Any], tokens: str) -> str:
    count = int(details.get("unexpected_count") or 0)
    rows = details.get("element_count")
    if kind == "expect_column_values_to_be_of_type":
        return f"{count} of {rows} prompts are not strings"
    if kind == "expect_column_values_to_not_be_null":
        return f"{count} of {rows} prompts are null"
    if kind == "expect_column_values_to_be_between":
        low, high = int(kwargs["min_value"]), int(kwargs["max_value"])
        return f"{count} of {rows} prompts are not {low}..{high} tokens long ({tokens})"
    if kind == "expect_column_values_to_be_unique":
        return f"{count} of {rows} rows repeat a prompt of another row"
    if kind == "expect_column_values_to_not_be_in_set":
        return f"{count} of {rows} eval prompts also appear in train (leakage)"
    return f"{count} of {rows} values unexpected"


def _examples(
    details: dict[str, Any],
    frame: pd.DataFrame,
    prompt_field: str,
    tokens_column: str,
    column: str | None,
) -> list[str]:
    """Up to three offending rows, as ``row <i>: <repr of the prompt>`` (plus its token count)."""
    indices = details.get("partial_unexpected_index_list") or []
    values = details.get("partial_unexpected_list") or []
    examples: list[str] = []
    for position, value in enumerate(values[: len(indices) or None]):
        row = indices[position] if indices else None
        if row is not None and prompt_field in frame.columns and 0 <= int(row) < len(frame):
            prompt = frame.at[int(row), prompt_field]
        else:
            prompt = html.unescape(value) if isinstance(value, str) else value
        text = short_repr(prompt)
        if column == tokens_column and row is not None:
            n_tokens = int(frame.at[int(row), tokens_column])
            if n_tokens >= 0:
                text += f" ({n_tokens} tokens)"
            elif text != "null":
                text += " (not a string)"
        examples.append(f"row {row}: {text}" if row is not None else text)
        if len(examples) == MAX_EXAMPLES:
            break
    return examples


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to ``EXAMPLE_CHARS`` characters; ``null`` for a missing value."""
    import pandas as pd

    if pd.api.types.is_scalar(value) and pd.isna(value):
        return "null"  # None, NaN or pd.NA, whichever the dtype made of a missing prompt
    text = repr(value)
    return text if len(text) <= EXAMPLE_CHARS else text[: EXAMPLE_CHARS - 3] + "..."


def token_stats(tokens: pd.Series) -> dict[str, float | int | None]:
    """Min, max and mean of the counted token lengths (-1 marks a value that was not counted)."""
    counted = tokens[tokens >= 0]
    if counted.empty:
        return {"min": None, "max": None, "mean": None}
    return {
        "min": int(counted.min()),
        "max": int(counted.max()),
        "mean": round(float(counted.mean()), 2),
    }
