"""The validate stage: bad data fails with the GE report written; the previous version stays."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from flows.stages import validate
from flows.validation import DataValidationError
from ppo_core.config import load_config


def write_version(folder, train, evals):
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"prompt": train}).to_parquet(folder / "train.parquet", index=False)
    pd.DataFrame({"prompt": evals}).to_parquet(folder / "eval.parquet", index=False)
    (folder / "manifest.json").write_text(json.dumps({"content_hash": str(hash(tuple(train)))}))


def stage_config(tmp_path, tiny_model_dir):
    """The validate stage's config with every folder under ``tmp_path``."""
    return load_config(
        overrides=[
            f"model.policy={tiny_model_dir}",
            f"data.interim_dir={tmp_path / 'interim'}",
            f"data.prepared_dir={tmp_path / 'prepared'}",
            f"validation.report_dir={tmp_path / 'report'}",
            "validation.min_train_rows=8",
            "validation.min_eval_rows=2",
        ]
    )


@pytest.mark.parametrize("problem", ["null", "duplicate", "too_long", "leak"])
def test_bad_data_fails_and_keeps_the_published_version(tmp_path, tiny_model_dir, problem):
    config = stage_config(tmp_path, tiny_model_dir)
    train = [f"The movie number {i} was" for i in range(20)]
    evals = [f"The film number {i} is" for i in range(5)]
    write_version(tmp_path / "interim", train, evals)
    published = validate(config)
    before = {p.name: p.read_bytes() for p in published.rglob("*") if p.is_file()}
    report = tmp_path / "report"
    passing_docs = (report / "data_docs" / "index.html").read_bytes()

    bad_train, bad_eval = list(train), list(evals)
    if problem == "null":
        bad_train[3] = None
    elif problem == "duplicate":
        bad_train[4] = bad_train[5]
    elif problem == "too_long":
        bad_eval[0] = " ".join(["wonderful"] * 60)
    else:
        bad_eval[1] = train[7]
    write_version(tmp_path / "interim", bad_train, bad_eval)
    with pytest.raises(DataValidationError) as caught:
        validate(config)
    failures = {(f.expectation, f.split) for f in caught.value.result.failures}
    expected = {  # a null prompt has no token count either, so its length check fails too
        "null": {
            ("expect_column_values_to_not_be_null", "train"),
            ("expect_column_values_to_be_between", "train"),
        },
        "duplicate": {("expect_column_values_to_be_unique", "train")},
        "too_long": {("expect_column_values_to_be_between", "eval")},
        "leak": {("expect_column_values_to_not_be_in_set", "eval")},
    }[problem]
    assert failures == expected, caught.value
    # this run's report, not the passing run's: it records the failures
    summary = json.loads((report / "summary.json").read_text())
    assert summary["success"] is False
    assert {(f["expectation"], f["split"]) for f in summary["failures"]} == expected
    assert (report / "data_docs" / "index.html").read_bytes() != passing_docs
    assert {p.name: p.read_bytes() for p in published.rglob("*") if p.is_file()} == before


def test_a_link_in_the_candidate_version_is_never_read_or_published(tmp_path, tiny_model_dir):
    """``data/interim/manifest.json`` linked to a private file: validate refuses it by name and
    publishes nothing, so the file it points to never reaches ``data/prepared``."""
    from ppo_core.prompts import PromptFileError

    config = stage_config(tmp_path, tiny_model_dir)
    train = [f"The movie number {i} was" for i in range(20)]
    write_version(tmp_path / "interim", train, [f"The film number {i} is" for i in range(5)])
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    manifest = tmp_path / "interim" / "manifest.json"
    manifest.unlink()
    manifest.symlink_to(secret)
    with pytest.raises(PromptFileError, match=r"manifest.json is not a regular file"):
        validate(config)
    assert not (tmp_path / "prepared").exists()


def test_the_bound_validate_held_the_prompts_to_is_what_train_and_evaluate_use(
    tmp_path, tiny_model_dir
):
    """``ppo validate validation.max_tokens=48`` publishes the bound with the version
    (``validated_with.json``); a stage run with the default of 32 adopts 48, saying so, since
    the published prompts may run to 48 tokens; a record of another data version (a prompt
    file copied over by hand) and a file without a record keep the stage's own bound."""
    from ppo_core.experience.sampling import BoundAdoptedWarning, with_validated_settings

    config = stage_config(tmp_path, tiny_model_dir)
    config.validation.max_tokens = 48
    train = [f"The movie number {i} was " + "very " * (i % 30) for i in range(20)]
    write_version(tmp_path / "interim", train, [f"The film number {i} is" for i in range(5)])
    published = validate(config)
    record = json.loads((published / "validated_with.json").read_text())
    assert record["max_tokens"] == 48 and record["min_tokens"] == config.validation.min_tokens
    run = load_config(overrides=[f"data.train_file={published / 'train.parquet'}"])
    assert run.validation.max_tokens == 32
    with pytest.warns(BoundAdoptedWarning, match=r"validation.max_tokens=32 differs from the 48"):
        adopted = with_validated_settings(run, run.data.train_file)
    assert adopted.validation.max_tokens == 48
    assert with_validated_settings(adopted, run.data.train_file) is adopted  # agrees: no word

    (published / "manifest.json").write_text(json.dumps({"content_hash": "another"}))
    assert with_validated_settings(run, run.data.train_file).validation.max_tokens == 32
    (published / "validated_with.json").unlink()
    assert with_validated_settings(run, run.data.train_file).validation.max_tokens == 32


def test_rows_without_their_reference_fields_fail_validation(tmp_path, tiny_model_dir):
    """A candidate version whose ``references`` column lacks a declared field on one row, or
    holds a null: validate fails with the Great Expectations check of the fields by name,
    and publishes nothing; with every field there it passes and records the fields."""
    config = stage_config(tmp_path, tiny_model_dir)
    config.data.reference_fields = ["answer"]
    train = [f"The movie number {i} was" for i in range(20)]
    evals = [f"The film number {i} is" for i in range(5)]
    write_version(tmp_path / "interim", train, evals)
    good = [json.dumps({"answer": str(i)}) for i in range(20)]
    for references, expected in (
        ([*good[:3], json.dumps({"other": 1}), *good[4:]], "expect_column_values_to_be_between"),
        ([*good[:3], None, *good[4:]], "expect_column_values_to_not_be_null"),
    ):
        frame = pd.DataFrame({"prompt": train, "references": references})
        frame.to_parquet(tmp_path / "interim" / "train.parquet", index=False)
        evals_frame = pd.DataFrame({"prompt": evals, "references": good[:5]})
        evals_frame.to_parquet(tmp_path / "interim" / "eval.parquet", index=False)
        with pytest.raises(DataValidationError) as caught:
            validate(config)
        failed = {(f.expectation, f.column, f.split) for f in caught.value.result.failures}
        column = "reference_fields_present" if "between" in expected else "references"
        assert (expected, column, "train") in failed, failed
        assert not (tmp_path / "prepared").exists()
    pd.DataFrame({"prompt": train, "references": good}).to_parquet(
        tmp_path / "interim" / "train.parquet", index=False
    )
    published = validate(config)
    assert json.loads((published / "validated_with.json").read_text())["reference_fields"] == [
        "answer"
    ]
