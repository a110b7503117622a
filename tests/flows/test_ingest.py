"""`ppo ingest` and the flow's inbox: files are checked before anything is written, added whole
or not at all, never replace another file, and reach the raw folder only when a run takes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.ingest import (
    INGESTED_EVENT,
    RAW_DATA_RESOURCE,
    inbox_files,
    ingest_files,
    ingested_event,
    set_aside_rejected,
    take_inbox,
)
from flows.stages import raw_changes
from ppo_core.config import Config
from ppo_core.modeling.data import PromptFileError


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    raw = tmp_path / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "prompts.jsonl").write_text('{"prompt": "the film was"}\n')
    return tmp_path


def prompts_file(path: Path, *prompts: str) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def listing(folder: Path) -> list[str]:
    """Every file under ``folder``, hidden ones too, relative to it."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_ingest_adds_checked_files_to_the_inbox_and_leaves_the_raw_folder_alone(
    project, tmp_path_factory
):
    outside = tmp_path_factory.mktemp("incoming")
    first = prompts_file(outside / "monday.jsonl", "a quiet story", "the acting")
    second = prompts_file(outside / "tuesday.jsonl", "music and")
    raw_before = listing(project / "data" / "raw")

    result = ingest_files(Config(), [first, second])

    assert [p.name for p in result.added] == ["monday.jsonl", "tuesday.jsonl"]
    assert result.prompts == {"monday.jsonl": 2, "tuesday.jsonl": 1}
    assert listing(project / "data" / "inbox") == ["monday.jsonl", "tuesday.jsonl"]
    assert (project / "data" / "inbox" / "monday.jsonl").read_bytes() == first.read_bytes()
    assert listing(project / "data" / "raw") == raw_before
    # Ingesting the same bytes again adds nothing.
    again = ingest_files(Config(), [first])
    assert again.added == [] and [p.name for p in again.already_there] == ["monday.jsonl"]


def test_a_malformed_file_names_the_file_and_line_and_nothing_is_added(project, tmp_path_factory):
    outside = tmp_path_factory.mktemp("incoming")
    good = prompts_file(outside / "good.jsonl", "fine prompt")
    bad = outside / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(PromptFileError, match=rf"{bad}:2"):
        ingest_files(Config(), [good, bad])
    assert listing(project / "data" / "inbox") == []  # no part file either

    for name, text, message in [
        ("empty.jsonl", "\n", "no prompts"),
        ("notes.txt", "hello", "reads only .jsonl and .parquet"),
    ]:
        path = outside / name
        path.write_text(text)
        with pytest.raises(PromptFileError, match=message):
            ingest_files(Config(), [path])
    with pytest.raises(PromptFileError, match="no such file"):
        ingest_files(Config(), [outside / "missing.jsonl"])
    assert listing(project / "data" / "inbox") == []


def test_ingest_never_replaces_a_file_of_the_same_name(project, tmp_path_factory):
    outside = tmp_path_factory.mktemp("incoming")
    clash = prompts_file(outside / "prompts.jsonl", "other bytes than the raw file")
    with pytest.raises(PromptFileError, match="already exists with other content"):
        ingest_files(Config(), [clash])
    assert (project / "data" / "raw" / "prompts.jsonl").read_text() == (
        '{"prompt": "the film was"}\n'
    )
    assert not (project / "data" / "inbox").exists()
    same = outside / "copy"
    same.mkdir()
    same_bytes = same / "prompts.jsonl"
    same_bytes.write_bytes((project / "data" / "raw" / "prompts.jsonl").read_bytes())
    assert ingest_files(Config(), [same_bytes]).added == []


def test_a_run_takes_the_inbox_into_the_raw_folder_and_sees_the_new_data(project, tmp_path_factory):
    outside = tmp_path_factory.mktemp("incoming")
    config = Config()
    ingest_files(config, [prompts_file(outside / "new.jsonl", "a new prompt")])
    assert raw_changes(config) == ["new prompts.jsonl"]  # no prepared version yet
    assert take_inbox(config) == ["new.jsonl"]
    assert inbox_files(config) == []
    assert listing(project / "data" / "raw") == ["new.jsonl", "prompts.jsonl"]
    assert take_inbox(config) == []


def test_files_rejected_by_validation_are_set_aside_with_the_reason(project, tmp_path_factory):
    outside = tmp_path_factory.mktemp("incoming")
    config = Config()
    ingest_files(config, [prompts_file(outside / "short.jsonl", "x")])
    taken = take_inbox(config)
    folder = set_aside_rejected(config, taken, "expect_column_values_to_be_between failed")
    assert (project / folder).parent == project / "data" / "rejected"
    assert listing(folder) == ["REASON.txt", "short.jsonl"]
    assert "expect_column_values_to_be_between" in (folder / "REASON.txt").read_text()
    assert listing(project / "data" / "raw") == ["prompts.jsonl"]


def test_the_event_names_the_files_and_carries_nothing_a_run_reads(project):
    result = ingest_files(Config(), [prompts_file(project / "extra.jsonl", "a", "b")])
    event = ingested_event(result, project)
    assert event["event"] == INGESTED_EVENT
    assert event["resource"]["prefect.resource.id"] == RAW_DATA_RESOURCE
    assert event["payload"] == {"files": ["extra.jsonl"], "prompts": 2}
    # prefect.yaml's trigger matches exactly this resource and event
    import yaml

    root = Path(__file__).resolve().parents[2]
    declared = yaml.safe_load((root / "prefect.yaml").read_text())["deployments"]
    [trigger] = [
        t
        for t in next(d for d in declared if d["name"] == "on-new-data")["triggers"]
        if INGESTED_EVENT in t["expect"]
    ]
    assert trigger["match"] == {"prefect.resource.id": RAW_DATA_RESOURCE}
    assert trigger["expect"] == [INGESTED_EVENT]
    assert "parameters" not in trigger


def test_the_command_without_a_prefect_server_says_no_run_was_triggered(project):
    new = prompts_file(project / "extra.jsonl", "one more prompt")
    result = CliRunner().invoke(app, ["ingest", str(new)])
    assert result.exit_code == 0, result.output
    assert "added data/inbox/extra.jsonl (1 prompts)" in result.output
    assert "PREFECT_API_URL is not set, so no run was triggered" in result.output
    bad = project / "bad.jsonl"
    bad.write_text("not json\n")
    result = CliRunner().invoke(app, ["ingest", str(bad)])
    assert result.exit_code == 2 and f"error: {bad}:1" in result.output
