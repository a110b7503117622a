"""Great Expectations validation of the prepared prompt splits (the `validate` stage's logic).

Each split (train, eval) is its own dataframe asset, expectation suite, validation definition and
checkpoint in an in-memory (ephemeral) GE context; the only things written to disk are the Data Docs
site (``report_dir/data_docs/index.html``) and ``report_dir/summary.json``. Nothing is written to
the working directory, and GE is imported inside the function so ``import flows.validation`` stays
cheap (docs/design.md section 7).

The frame GE sees for a split is ``{prompt_field: <the prompts as Python objects>, "n_tokens": int}``:
``n_tokens`` is derived here with the caller's token counter (-1 where the prompt is null or not a
string), so the schema expectation asks for exactly those two columns; any other column in the input
is reported as unexpected. Should the input already hold a column called ``n_tokens``, the derived
one gets a free name (``n_tokens_``...) so the input's column is still reported. The prompts are
handed to GE with object dtype so that the string-type check looks at every value, whatever string
dtype pandas chose.
"""

from __future__ import annotations

import html
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.validation_results import read_result, token_stats
from ppo_core.files import atomic_write_text, clear_output_folder
from ppo_core.files.artifacts import VALIDATION_SUMMARY
from ppo_core.prompts import MAX_LINE_BYTES
from ppo_core.references import REFERENCES_COLUMN

if TYPE_CHECKING:
    import pandas as pd

SPLITS = ("train", "eval")
DOCS_SITE = "prompt_validation"


@dataclass
class FailedExpectation:
    """One expectation that did not hold on one split."""

    expectation: str  # GE expectation type, e.g. "expect_column_values_to_not_be_null"
    split: str  # "train" or "eval"
    column: str | None  # the column checked; None for table-level expectations
    unexpected_count: int  # rows violating it (0 for table-level expectations)
    examples: list[str]  # up to 3 offending values, "row <i>: <repr>" for column checks
    details: str  # one line: what was observed against what was expected


@dataclass
class ValidationResult:
    """The outcome of `validate_prompt_splits`, with where its reports were written."""

    success: bool
    failures: list[FailedExpectation]
    evaluated: int  # number of expectations evaluated, both splits together
    docs_index: Path  # the Data Docs index.html under report_dir
    summary_path: Path  # report_dir / VALIDATION_SUMMARY
    splits: dict[str, int] = field(default_factory=dict)  # rows per split, for the summary line
    what: str = "Prompt data validation"  # what was validated, as describe() names it
    data: str = "prompt data"  # the data to fix, as DataValidationError names it
    notes: list[str] = field(default_factory=list)  # lines describe() adds, pass or fail

    def describe(self) -> str:
        """A multi-line summary for people: one line per failed expectation."""
        rows = ", ".join(f"{name} {count} rows" for name, count in self.splits.items())
        rows = f" ({rows})" if rows else ""
        if self.success:
            return "\n".join(
                [f"{self.what} passed: {self.evaluated} expectations{rows}.", *self.notes]
            )
        lines = [
            f"{self.what} failed: {len(self.failures)} of {self.evaluated} expectations{rows}."
        ]
        for failure in self.failures:
            column = f" on '{failure.column}'" if failure.column is not None else ""
            count = f", {failure.unexpected_count} row(s)" if failure.unexpected_count else ""
            line = f"  - [{failure.split}] {failure.expectation}{column}{count}: {failure.details}"
            if failure.examples:
                line += "; e.g. " + " | ".join(failure.examples)
            lines.append(line)
        lines += self.notes
        lines.append(f"Full results: {self.summary_path}")
        return "\n".join(lines)


class DataValidationError(ValueError):
    """The validated data (prepared prompts, feedback pairs) broke at least one expectation."""

    def __init__(self, result: ValidationResult):
        self.result = result
        super().__init__(
            f"{result.describe()}\n"
            f"Data Docs: {result.docs_index}\n"
            f"Fix the {result.data} (or the validation bounds in the config) and rerun."
        )


def validate_prompt_splits(
    train: pd.DataFrame,
    eval: pd.DataFrame,
    *,
    prompt_field: str = "prompt",
    count_tokens: Callable[[list[str]], list[int]],
    min_tokens: int,
    max_tokens: int,
    min_train_rows: int,
    min_eval_rows: int,
    report_dir: str | Path,
    reference_fields: Sequence[str] = (),
) -> ValidationResult:
    """Validate the train and eval prompt splits with Great Expectations; write Data Docs and a summary.

    Per split: columns are exactly ``[prompt_field, "n_tokens"]``, prompts are non-null unique
    strings of ``min_tokens..max_tokens`` tokens (``count_tokens``, the policy tokenizer's counter),
    at least ``min_train_rows`` / ``min_eval_rows`` rows; on eval, no prompt also in train.
    With ``reference_fields``, also the ``references`` column: not null, at most 1 MiB a row,
    the JSON of an object holding every field (the derived ``reference_fields_present``).
    Never raises on bad data: the result says what failed (raise `DataValidationError` with it).
    """
    if min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) is larger than max_tokens ({max_tokens})")
    report_dir = Path(report_dir).resolve()
    docs_dir = report_dir / "data_docs"
    ge = fresh_context(docs_dir)
    frames = {"train": train, "eval": eval}
    min_rows = {"train": min_train_rows, "eval": min_eval_rows}
    train_prompts = string_values(train[prompt_field]) if prompt_field in train.columns else []
    split_reports: dict[str, dict[str, Any]] = {}
    for split in SPLITS:
        frame, tokens_column = _frame_for_ge(frames[split], prompt_field, count_tokens, split)
        expectations = _expectations(
            ge.gx,
            prompt_field,
            tokens_column,
            min_tokens,
            max_tokens,
            min_rows[split],
            leak_set=[html.escape(p) for p in train_prompts] if split == "eval" else None,
        )
        if reference_fields:
            frame = _with_references_present(frame, reference_fields)
            expectations = _reference_expectations(ge.gx, expectations, reference_fields)
        split_reports[split] = _split_report(
            ge, split, frames[split], frame, expectations, prompt_field, tokens_column
        )

    checks = [check for report in split_reports.values() for check in report["expectations"]]
    failures = [
        FailedExpectation(**{k: check[k] for k in FAILURE_FIELDS})
        for check in checks
        if not check["success"]
    ]
    docs_index = docs_dir / "index.html"
    if not docs_index.is_file():
        raise RuntimeError(f"Great Expectations did not write its Data Docs index at {docs_index}")
    result = ValidationResult(
        success=not failures,
        failures=failures,
        evaluated=len(checks),
        docs_index=docs_index,
        summary_path=report_dir / VALIDATION_SUMMARY,
        splits={split: report["rows"] for split, report in split_reports.items()},
    )
    settings = {
        "prompt_field": prompt_field,
        "min_tokens": min_tokens,
        "max_tokens": max_tokens,
        "min_train_rows": min_train_rows,
        "min_eval_rows": min_eval_rows,
        "reference_fields": list(reference_fields),
    }
    _write_summary(result, settings, split_reports, ge.gx.__version__)
    return result


def _split_report(
    ge,
    split: str,
    given: pd.DataFrame,
    frame: pd.DataFrame,
    expectations: list,
    prompt_field: str,
    tokens_column: str,
) -> dict[str, Any]:
    """One split's suite run on ``frame`` (``given`` with its derived columns): its rows,
    columns, outcome, token statistics and each expectation's record."""
    # Data Docs show the values that fail (and the leak set) as HTML: GE gets each prompt
    # HTML-escaped, which changes no outcome (escaping is one-to-one, lengths are counted
    # from the text itself); the summary's examples are read from the prompts as they are.
    checks = [
        read_result(outcome, split, frame, prompt_field, tokens_column)
        for outcome in ge.check(split, expectations, _escaped(frame, prompt_field))
    ]
    return {
        "rows": len(frame),
        "columns": [str(c) for c in given.columns],
        "success": all(check["success"] for check in checks),
        "n_tokens": token_stats(frame[tokens_column]),
        "expectations": checks,
    }


def _write_summary(
    result: ValidationResult,
    settings: dict[str, Any],
    split_reports: dict[str, dict[str, Any]],
    gx_version: str,
) -> None:
    """``summary.json``: the outcome, the settings, each split's report and every failure."""
    summary = {
        "success": result.success,
        "evaluated": result.evaluated,
        "failed": len(result.failures),
        "settings": settings,
        "splits": split_reports,
        "failures": [asdict(failure) for failure in result.failures],
        "docs_index": recorded_path(result.docs_index, result.summary_path.parent),
        "great_expectations_version": gx_version,
    }
    atomic_write_text(result.summary_path, json.dumps(summary, indent=2, default=str) + "\n")


@dataclass
class GreatExpectations:
    """One validation's Great Expectations: the module, an ephemeral context, its pandas data
    source, the run identifier both splits share (one run, one time stamp), the Data Docs site's
    name and the prefix of each split's suite, validation definition and checkpoint names."""

    gx: Any
    context: Any
    source: Any
    run_id: Any
    site: str = DOCS_SITE
    prefix: str = "prompts"

    def check(self, split: str, expectations: list[Any], frame: pd.DataFrame) -> list[dict]:
        """Each expectation's outcome (as JSON) on ``frame``, through a checkpoint of ``split``
        (suite, batch definition, validation definition) that also updates the Data Docs."""
        gx, context = self.gx, self.context
        name = f"{self.prefix}_{split}"
        suite = context.suites.add(gx.ExpectationSuite(name=name))
        for expectation in expectations:
            suite.add_expectation(expectation)
        batch = self.source.add_dataframe_asset(split).add_batch_definition_whole_dataframe(split)
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(name=name, data=batch, suite=suite)
        )
        checkpoint = context.checkpoints.add(
            gx.Checkpoint(
                name=name,
                validation_definitions=[definition],
                actions=[gx.checkpoint.UpdateDataDocsAction(name="docs", site_names=[self.site])],
                result_format={"result_format": "SUMMARY"},
            )
        )
        run = checkpoint.run(batch_parameters={"dataframe": frame}, run_id=self.run_id)
        (suite_result,) = run.run_results.values()
        return [outcome.to_json_dict() for outcome in suite_result.results]


def fresh_context(
    docs_dir: Path,
    *,
    site: str = DOCS_SITE,
    run_name: str = "prompt_validation",
    prefix: str = "prompts",
) -> GreatExpectations:
    """Great Expectations with an ephemeral context whose Data Docs site ``site`` is
    ``docs_dir``, emptied first: a rebuilt site would otherwise keep the pages of earlier runs
    beside this one's; a link at its place (or inside it) is removed, never followed. Only
    ``docs_dir`` itself is cleared, so sites in sibling or parent folders stay as they are."""
    docs_dir.parent.mkdir(parents=True, exist_ok=True)
    clear_output_folder(docs_dir)
    gx = _import_gx()
    from great_expectations.core.run_identifier import RunIdentifier  # after _import_gx's setup

    context = _ephemeral_context(gx, docs_dir, site)
    return GreatExpectations(
        gx,
        context,
        context.data_sources.add_pandas(prefix),
        RunIdentifier(run_name=run_name),
        site=site,
        prefix=prefix,
    )


FAILURE_FIELDS = ("expectation", "split", "column", "unexpected_count", "examples", "details")


def recorded_path(path: Path, report_dir: Path) -> str:
    """``path`` (under the resolved ``report_dir``) as the summary records it: relative to the
    working folder when it lies inside it, else to the report folder. The summary is shared (DVC,
    CI artifacts); an absolute path would record the user's folders."""
    try:
        return path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return path.relative_to(report_dir).as_posix()


def _import_gx():
    """Import Great Expectations offline and quietly."""
    # GE would read this when a context starts; the pipeline must never phone home.
    os.environ["GX_ANALYTICS_ENABLED"] = "false"
    import great_expectations as gx

    # Its INFO/WARNING chatter (store set-up, docs building) belongs in the reports, not the log.
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    return gx


def _ephemeral_context(gx, docs_dir: Path, site: str):
    """An in-memory context whose only Data Docs site, ``site``, writes HTML into ``docs_dir``."""
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    config = DataContextConfig(
        # init_temp_docs_sites=False: no default site in a temporary folder beside ours.
        store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
        data_docs_sites={
            site: {
                "class_name": "SiteBuilder",
                "show_how_to_buttons": False,
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
                "store_backend": {
                    "class_name": "TupleFilesystemStoreBackend",
                    "base_directory": str(docs_dir),
                },
            }
        },
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False),
    )
    return gx.get_context(mode="ephemeral", project_config=config)


def string_values(column: pd.Series) -> list[str]:
    """The distinct string values of a column, in first-seen order."""
    return list(dict.fromkeys(value for value in column if isinstance(value, str)))


def _frame_for_ge(
    frame: pd.DataFrame,
    prompt_field: str,
    count_tokens: Callable[[list[str]], list[int]],
    split: str,
) -> tuple[pd.DataFrame, str]:
    """A copy of ``frame`` with prompts as objects and a derived token-count column; its name."""
    tokens_column = "n_tokens"
    while tokens_column in frame.columns:
        tokens_column += "_"
    out = frame.reset_index(drop=True)
    if prompt_field in out.columns:
        # object dtype: GE then checks the type of each value instead of the column's dtype.
        out[prompt_field] = out[prompt_field].astype(object)
        values = out[prompt_field].tolist()
    else:
        values = [None] * len(out)
    texts = [value for value in values if isinstance(value, str)]
    counts = list(count_tokens(texts)) if texts else []
    if len(counts) != len(texts):
        raise ValueError(
            f"count_tokens returned {len(counts)} counts for {len(texts)} {split} prompts; "
            "it must return one count per text"
        )
    counts_iter = iter(counts)
    out[tokens_column] = [int(next(counts_iter)) if isinstance(v, str) else -1 for v in values]
    return out, tokens_column


PRESENT_COLUMN = "reference_fields_present"
"""Derived: how many of ``data.reference_fields`` a row's ``references`` object holds, not null
(-1 when it is not the JSON of an object)."""


def _with_references_present(frame: pd.DataFrame, fields: Sequence[str]) -> pd.DataFrame:
    """``frame`` with :data:`PRESENT_COLUMN` beside its ``references`` column."""
    out = frame.copy()
    values = out[REFERENCES_COLUMN].tolist() if REFERENCES_COLUMN in out.columns else []
    present = []
    for value in values:
        try:
            record = json.loads(value) if isinstance(value, str) else None
        except (ValueError, RecursionError):
            record = None
        present.append(
            sum(record.get(f) is not None for f in fields) if isinstance(record, dict) else -1
        )
    out[PRESENT_COLUMN] = present if values else [-1] * len(out)
    if REFERENCES_COLUMN in out.columns:
        out[REFERENCES_COLUMN] = out[REFERENCES_COLUMN].astype(object)
    return out


def _reference_expectations(gx, suite: list, fields: Sequence[str]) -> list:
    """The prompt suite with its column set widened to the references and their checks."""
    e = gx.expectations
    columns = next(x for x in suite if isinstance(x, e.ExpectTableColumnsToMatchSet))
    columns.column_set = [*columns.column_set, REFERENCES_COLUMN, PRESENT_COLUMN]
    names = ", ".join(f"`{name}`" for name in fields)
    return [
        *suite,
        e.ExpectColumnValuesToNotBeNull(column=REFERENCES_COLUMN),
        e.ExpectColumnValueLengthsToBeBetween(
            column=REFERENCES_COLUMN,
            min_value=2,
            max_value=MAX_LINE_BYTES,
            description=f"Each row's reference fields are at most {MAX_LINE_BYTES} characters",
        ),
        e.ExpectColumnValuesToBeBetween(
            column=PRESENT_COLUMN,
            min_value=len(fields),
            max_value=len(fields),
            description=f"Every row carries the reference fields {names}, none null",
        ),
    ]


def _escaped(frame: pd.DataFrame, prompt_field: str) -> pd.DataFrame:
    """``frame`` with every string prompt HTML-escaped (``<`` as ``&lt;`` ...), other values as
    they are."""
    if prompt_field not in frame.columns:
        return frame
    out = frame.copy()
    out[prompt_field] = [
        html.escape(value) if isinstance(value, str) else value for value in frame[prompt_field]
    ]
    out[prompt_field] = out[prompt_field].astype(object)
    return out


def _expectations(
    gx,
    prompt_field: str,
    tokens_column: str,
    min_tokens: int,
    max_tokens: int,
    min_rows: int,
    leak_set: list[str] | None,
) -> list:
    """The suite of one split (``leak_set``: the train prompts, checked on eval only)."""
    e = gx.expectations
    suite = [
        e.ExpectTableColumnsToMatchSet(
            column_set=[prompt_field, tokens_column],
            exact_match=True,
            description=f"Columns are exactly `{prompt_field}` and the derived `{tokens_column}`",
        ),
        e.ExpectColumnValuesToBeOfType(column=prompt_field, type_="str"),
        e.ExpectColumnValuesToNotBeNull(column=prompt_field),
        e.ExpectColumnValuesToBeBetween(
            column=tokens_column,
            min_value=min_tokens,
            max_value=max_tokens,
            description=(
                f"Prompt length in tokens (`{tokens_column}`, -1 for a null or non-string prompt) "
                f"is between {min_tokens} and {max_tokens}"
            ),
        ),
        e.ExpectColumnValuesToBeUnique(column=prompt_field),
        e.ExpectTableRowCountToBeBetween(min_value=min_rows, max_value=None),
    ]
    if leak_set is not None:
        # The description keeps the docs from listing every train prompt.
        suite.append(
            e.ExpectColumnValuesToNotBeInSet(
                column=prompt_field,
                value_set=leak_set,
                description=f"No eval prompt is one of the {len(leak_set)} train prompts",
            )
        )
    return suite
