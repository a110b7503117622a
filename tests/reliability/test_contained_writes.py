"""Outputs stay inside the project (or a root the user allows), never replace its repository,
sources or raw data, never replace a folder the pipeline did not write, and copies of model
folders take regular files only, within a size cap, without recording where a user keeps them."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.stages import base
from ppo_core import files
from ppo_core.config import ConfigError, load_config
from ppo_core.files import copying
from ppo_core.files.output_paths import PROTECTED
from ppo_core.models.policy import load_causal_lm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A small project as the working folder: a repository, DVC, sources and raw prompts. The
    system's temporary folder is pointed at a scratch folder beside it, so that "outside" below
    means outside every root outputs may go to."""
    folder = tmp_path / "project"
    for name in (".git", ".dvc", "ppo_core", "flows", "tests", "data/raw"):
        (folder / name).mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / ".dvc" / "config").write_text("[core]\n")
    (folder / "ppo_core" / "__init__.py").write_text("")
    prompts = (ROOT / "data" / "raw" / "prompts.jsonl").read_text().splitlines()[:60]
    (folder / "data" / "raw" / "prompts.jsonl").write_text("\n".join(prompts) + "\n")
    (tmp_path / "scratch").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    monkeypatch.delenv("PPO_ALLOWED_OUTPUT_ROOTS", raising=False)
    monkeypatch.chdir(folder)
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


# --- 1. where outputs may go ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("data.interim_dir", ".git", "is .git, a protected part of the project"),
        ("data.interim_dir", "data/raw", "is data/raw, a protected part"),
        ("data.interim_dir", "data", "contains data/raw, a protected part"),
        ("train.output_dir", "ppo_core", "is ppo_core, a protected part"),
        ("train.checkpoint_dir", "tests/checkpoints", "lies inside tests, a protected part"),
        ("promote.report", ".dvc/config", "lies inside .dvc, a protected part"),
        ("promote.registry", "params.yaml", "is params.yaml, a protected part"),
        ("train.output_dir", ".venv", "is .venv, a protected part"),
        ("eval.output_dir", "flows/../.git/refs", "lies inside .git, a protected part"),
        ("data.interim_dir", "{project}/.git", "is .git, a protected part"),
        ("data.interim_dir", "{project}/data/raw", "is data/raw, a protected part"),
        ("data.interim_dir", "{tmp}/elsewhere/interim", "outside the project"),
        ("train.output_dir", "/", "outside the project"),
        ("train.output_dir", "{tmp}", "outside the project"),
        ("data.interim_dir", ".", "is the project folder itself"),
        ("data.interim_dir", "{project}", "is the project folder itself"),
        ("train.output_dir", "{tmp}/scratch", "is the allowed output root"),
    ],
)
def test_an_output_may_not_replace_the_repository_sources_or_anything_outside(
    project, key, value, message
):
    value = value.format(project=project, tmp=project.parent)
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(overrides=[f"{key}={value}"])
    assert f"{key}=" in str(raised.value) and "\n" not in str(raised.value)


# What PROTECTED held when the test below was written: an entry that leaves the list fails it
# here, while an entry added to the list is tested the day it is added.
PROTECTED_WHEN_WRITTEN = (
    ".git",
    ".dvc",
    ".venv",
    "ppo_core",
    "flows",
    "tests",
    "bench",
    "docs",
    "data/raw",
    "params.yaml",
    "dvc.yaml",
    "dvc.lock",
    "pyproject.toml",
)


@pytest.mark.parametrize("entry", sorted(set(PROTECTED) | set(PROTECTED_WHEN_WRITTEN)))
def test_every_protected_entry_is_refused(project, entry):
    """Every entry of ``ppo_core.files.output_paths.PROTECTED``, by a relative and an absolute path:
    the entry itself, a path inside it and (for a nested entry) the folder that holds it."""
    cases = [(entry, "is"), (f"{entry}/out", "lies inside"), (f"{project}/{entry}", "is")]
    if "/" in entry:
        cases.append((entry.rsplit("/", 1)[0], "contains"))
    for value, relation in cases:
        with pytest.raises(ConfigError) as raised:
            load_config(overrides=[f"train.checkpoint_dir={value}"])
        expected = f"train.checkpoint_dir='{value}' {relation} {entry}, a protected part"
        assert re.match(re.escape(expected), str(raised.value)), (value, str(raised.value))


def test_paths_through_symlinked_folders_count_where_they_point(project):
    (project / "repo").symlink_to(project / ".git")
    (project / "self").symlink_to(project)
    (project / "out").symlink_to(project.parent / "elsewhere")
    cases = [
        ("data.interim_dir", "repo", "is .git, a protected part"),
        ("data.interim_dir", "self/.git", "is .git, a protected part"),
        ("data.interim_dir", "self/data/raw/x", "lies inside data/raw"),
        ("train.output_dir", "out/candidate", "outside the project"),
    ]
    for key, value, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=[f"{key}={value}"])
    # a symlinked folder that points inside the project is where it points: allowed
    (project / "storage").mkdir()
    (project / "models").symlink_to(project / "storage")
    load_config(overrides=["train.output_dir=models/candidate"])


def test_outputs_may_not_replace_the_data_a_run_reads(project):
    with pytest.raises(ConfigError, match=r"would write over data\.raw_dir"):
        load_config(overrides=["data.raw_dir=mine", "data.interim_dir=mine/interim"])
    with pytest.raises(ConfigError, match=r"would write over data\.train_file"):
        load_config(overrides=["data.train_file=mine/train.parquet", "train.output_dir=mine"])
    with pytest.raises(ConfigError, match=r"would write over data\.eval_file"):
        load_config(overrides=["data.eval_file=mine/eval.parquet", "eval.output_dir=mine"])
    # the prepared version holds the train and eval files: publishing it is its purpose
    load_config(overrides=["data.train_file=data/prepared/train.parquet"])
    load_config(overrides=["data.interim_dir=prompts", "data.train_file=prompts/train.parquet"])


def test_roots_outside_the_project_are_allowed_explicitly(project, monkeypatch):
    elsewhere, other = project.parent / "elsewhere", project.parent / "other"
    scratch = project.parent / "scratch"
    load_config(overrides=[f"train.output_dir={scratch}/candidate"])  # the temporary folder
    with pytest.raises(ConfigError, match="PPO_ALLOWED_OUTPUT_ROOTS"):
        load_config(overrides=[f"train.checkpoint_dir={elsewhere}/checkpoints"])
    monkeypatch.setenv("PPO_ALLOWED_OUTPUT_ROOTS", f"{other}{os.pathsep}{elsewhere}")
    config = load_config(
        overrides=[
            f"train.checkpoint_dir={elsewhere}/checkpoints",
            f"train.output_dir={other}/candidate",
        ]
    )
    assert config.train.checkpoint_dir == f"{elsewhere}/checkpoints"
    with pytest.raises(ConfigError, match="is the allowed output root"):
        load_config(overrides=[f"train.output_dir={elsewhere}"])


def test_the_defaults_are_allowed(project):
    load_config()


def test_prepare_into_the_repository_is_refused_in_one_line(project):
    before = snapshot(project / ".git")
    result = CliRunner().invoke(app, ["prepare", "data.interim_dir=.git"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "data.interim_dir='.git' is .git, a protected part" in result.output
    assert snapshot(project / ".git") == before


def test_base_into_the_repository_is_refused(project, tiny_model_dir):
    before = snapshot(project / ".git")
    result = CliRunner().invoke(app, ["base", f"base.source={tiny_model_dir}", "model.policy=.git"])
    assert result.exit_code == 2, result.output
    assert "model.policy='.git' is .git, a protected part" in result.output
    assert snapshot(project / ".git") == before


def test_a_folder_the_pipeline_did_not_write_is_not_replaced(project):
    notes = project / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    result = CliRunner().invoke(app, ["prepare", "data.interim_dir=notes"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "notes" in result.output and "move it away or choose another" in result.output
    assert snapshot(notes) == {"todo.txt": b"keep me"}
    assert sorted(p.name for p in project.iterdir()) == [
        ".dvc",
        ".git",
        "data",
        "flows",
        "notes",
        "ppo_core",
        "tests",
    ]  # no temporary folder left
    # its own output it replaces, again and again
    for _ in range(2):
        result = CliRunner().invoke(app, ["prepare", "data.interim_dir=data/interim"])
        assert result.exit_code == 0, result.output
        assert (project / "data" / "interim" / files.OUTPUT_MARKER).is_file()


def test_a_model_written_into_an_output_folder_still_loads(tiny_model_dir):
    # the tiny default is saved with save_pretrained inside atomic_folder
    assert (tiny_model_dir / files.OUTPUT_MARKER).is_file()
    load_causal_lm(tiny_model_dir, "model.policy", False)


# --- 2. copies of model folders ---------------------------------------------------------------


def model_with(tmp_path: Path, tiny_model_dir: Path, name: str = "source") -> Path:
    source = tmp_path / name
    shutil.copytree(tiny_model_dir, source)
    return source


def test_base_does_not_copy_a_link_to_a_private_file(tmp_path, tiny_model_dir):
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    source = model_with(tmp_path, tiny_model_dir)
    (source / "notes").mkdir()
    (source / "notes" / "key").symlink_to(secret)
    config = load_config(overrides=[f"base.source={source}", f"model.policy={tmp_path / 'base'}"])
    with pytest.raises(FileExistsError, match=r"notes/key is a symbolic link") as raised:
        base(config)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "base").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    result = CliRunner().invoke(
        app, ["base", f"base.source={source}", f"model.policy={tmp_path / 'base'}"]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "is a symbolic link" in result.output
    assert not (tmp_path / "base").exists()


def test_base_refuses_a_source_over_the_size_cap_before_copying(
    tmp_path, tiny_model_dir, monkeypatch
):
    source = model_with(tmp_path, tiny_model_dir)
    monkeypatch.setattr(copying, "MAX_COPY_BYTES", 1000)
    config = load_config(overrides=[f"base.source={source}", f"model.policy={tmp_path / 'base'}"])
    with pytest.raises(FileExistsError, match="more than the 1000 bytes"):
        base(config)
    assert not (tmp_path / "base").exists()


# --- 3. what the import records -------------------------------------------------------------


def test_an_import_from_outside_the_project_records_its_name_and_a_hash(tmp_path, tiny_model_dir):
    source = model_with(tmp_path, tiny_model_dir, "my-model")
    config = load_config(overrides=[f"base.source={source}", f"model.policy={tmp_path / 'base'}"])
    text = (base(config) / "imported_from.json").read_text()
    record = json.loads(text)
    assert record["source"] == "my-model" and record["inside_project"] is False
    assert str(tmp_path) not in text and str(source) not in text
    assert len(record["content_sha256"]) == 64
    # the same content under another name has the same hash; changed weights another one
    again = model_with(tmp_path, tiny_model_dir, "copy")
    config = load_config(overrides=[f"base.source={again}", f"model.policy={tmp_path / 'b2'}"])
    assert (
        json.loads((base(config) / "imported_from.json").read_text())["content_sha256"]
        == (record["content_sha256"])
    )
    with (again / "model.safetensors").open("ab") as handle:
        handle.write(b"\0")
    assert files.folder_fingerprint(again) != record["content_sha256"]


def test_an_import_from_inside_the_project_records_its_relative_path(project, tiny_model_dir):
    shutil.copytree(tiny_model_dir, project / "imports" / "m")
    config = load_config(overrides=["base.source=imports/m"])
    record = json.loads((base(config) / "imported_from.json").read_text())
    assert record["source"] == "imports/m" and record["inside_project"] is True
    assert str(project) not in json.dumps(record)


def _outside_with_a_file(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("the owner's file")
    return outside, {"keep.txt": b"the owner's file"}


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_link_inside_the_metrics_folder_takes_no_write_or_deletion_outside(tmp_path):
    """DVCLive cleans up its plots folder when it starts and writes a file per metric there: a
    link planted at ``reports/train/plots`` (and at ``curves.png``) is removed with a warning
    first, and the folder it pointed to is untouched."""
    from flows.loggers import DVCLiveLogger

    outside, before = _outside_with_a_file(tmp_path)
    metrics = tmp_path / "reports" / "train"
    metrics.mkdir(parents=True)
    (metrics / "plots").symlink_to(outside, target_is_directory=True)
    (metrics / "curves.png").symlink_to(outside / "keep.txt")
    logger = DVCLiveLogger(metrics)
    with pytest.warns(UserWarning, match="removed the symbolic link .*plots"):
        logger.log(1, {"rollout/score": 0.5, "rollout/kl": 0.1})
    logger.close()
    assert _contents(outside) == before
    assert (metrics / "plots").is_dir() and not (metrics / "plots").is_symlink()
    assert not (metrics / "curves.png").is_symlink()
    assert any((metrics / "plots").rglob("*.tsv"))


def test_a_link_at_the_data_docs_folder_takes_no_page_outside(tmp_path):
    from flows.validation import validate_prompt_splits

    outside, before = _outside_with_a_file(tmp_path)
    reports = tmp_path / "reports" / "validation"
    reports.mkdir(parents=True)
    (reports / "data_docs").symlink_to(outside, target_is_directory=True)
    train = pd.DataFrame({"prompt": [f"The movie number {i} was" for i in range(40)]})
    eval_ = pd.DataFrame({"prompt": [f"A film called {i} is" for i in range(10)]})
    result = validate_prompt_splits(
        train,
        eval_,
        count_tokens=lambda texts: [len(t.split()) for t in texts],
        min_tokens=1,
        max_tokens=8,
        min_train_rows=16,
        min_eval_rows=4,
        report_dir=reports,
    )
    assert result.success
    assert _contents(outside) == before
    assert not (reports / "data_docs").is_symlink()
    assert (reports / "data_docs" / "index.html").is_file()


def test_an_output_file_the_pipeline_did_not_write_is_never_replaced(project):
    """The project's own files are protected by name; any other existing file may be replaced
    only when it is what the pipeline wrote there (a promotion report), checked before the
    promotion decides anything."""
    result = CliRunner().invoke(app, ["promote", "promote.report=prefect.yaml"])
    assert result.exit_code == 2 and "is prefect.yaml, a protected part" in result.output
    notes = project / "notes.json"
    notes.write_text('{"mine": 1}\n')
    outside = project.parent / "scratch" / "kept.json"
    outside.write_text('{"decision": "promoted"}\n')
    (project / "linked.json").symlink_to(outside)
    for name, kind in [
        ("notes.json", "not a promotion report"),
        ("linked.json", "a symbolic link"),
    ]:
        result = CliRunner().invoke(app, ["promote", f"promote.report={name}"])
        assert result.exit_code == 2, result.output
        expected = f"error: promote.report='{name}' exists and is {kind} this pipeline wrote"
        assert result.output.startswith(expected), result.output
    assert notes.read_text() == '{"mine": 1}\n'
    assert outside.read_text() == '{"decision": "promoted"}\n'
    # a report of an earlier promotion is the pipeline's: the check lets it be replaced (the
    # stage then stops at the missing evaluation here)
    (project / "reports").mkdir()
    (project / "reports" / "promotion.json").write_text('{"decision": "rejected"}\n')
    result = CliRunner().invoke(app, ["promote"])
    assert "metrics.json is missing" in result.output, result.output
