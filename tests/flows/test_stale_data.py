"""`ppo train` refuses raw prompts that the prepared version has not taken in, and says which
command brings it up to date."""

import json

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.raw_data import StaleDataError, check_raw_data_is_prepared
from flows.stages import prepare
from ppo_core.config import load_config


def write_jsonl(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


@pytest.fixture
def prepared(tmp_path):
    """Raw prompts in tmp_path/raw, prepared into tmp_path/prepared; returns the overrides."""
    (tmp_path / "raw").mkdir()
    write_jsonl(tmp_path / "raw" / "a.jsonl", [f"The film number {i} was" for i in range(30)])
    overrides = [
        f"data.raw_dir={tmp_path / 'raw'}",
        f"data.interim_dir={tmp_path / 'prepared'}",
        f"data.train_file={tmp_path / 'prepared' / 'train.parquet'}",
        "data.eval_fraction=0.3",
    ]
    prepare(load_config(overrides=overrides))
    return overrides


def test_unchanged_raw_data_passes(prepared):
    check_raw_data_is_prepared(load_config(overrides=prepared))


@pytest.mark.parametrize("change", ["new", "changed", "removed"])
def test_new_changed_or_removed_raw_files_are_named(tmp_path, prepared, change):
    raw = tmp_path / "raw"
    if change == "new":
        write_jsonl(raw / "mine.jsonl", ["A fresh prompt about a show"])
        name = "mine.jsonl"
    elif change == "changed":
        with (raw / "a.jsonl").open("a") as f:
            f.write(json.dumps({"prompt": "One more line"}) + "\n")
        name = "a.jsonl"
    else:
        write_jsonl(raw / "b.jsonl", ["Another prompt"])
        prepare(load_config(overrides=prepared))
        (raw / "b.jsonl").unlink()
        name = "b.jsonl"
    with pytest.raises(StaleDataError) as caught:
        check_raw_data_is_prepared(load_config(overrides=prepared))
    message = str(caught.value)
    assert f"{change} {name}" in message
    assert "ppo prepare && ppo validate" in message and "train.allow_stale_data=true" in message
    # the key lets a user train on the prepared version on purpose
    check_raw_data_is_prepared(load_config(overrides=[*prepared, "train.allow_stale_data=true"]))


def test_no_manifest_or_no_raw_folder_is_not_checked(tmp_path, prepared):
    outside = tmp_path / "elsewhere.parquet"
    check_raw_data_is_prepared(load_config(overrides=[*prepared, f"data.train_file={outside}"]))
    no_raw = [*prepared, f"data.raw_dir={tmp_path / 'missing'}"]
    check_raw_data_is_prepared(load_config(overrides=no_raw))


def test_ppo_train_stops_on_stale_data_before_writing_anything(tmp_path, prepared, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "raw" / "mine.jsonl", ["A fresh prompt about a show"])
    outputs = [
        f"train.output_dir={tmp_path / 'candidate'}",
        f"train.checkpoint_dir={tmp_path / 'checkpoints'}",
        f"train.metrics_dir={tmp_path / 'train-metrics'}",
    ]
    result = CliRunner().invoke(app, ["train", *prepared, *outputs])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "new mine.jsonl" in message and "ppo prepare && ppo validate" in message
    assert "Traceback" not in result.output
    assert not any(
        (tmp_path / name).exists() for name in ("candidate", "checkpoints", "train-metrics")
    )
