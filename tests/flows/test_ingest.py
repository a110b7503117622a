"""`ppo ingest` and the flow's inbox: files are checked before anything is written, added whole
or not at all, never replace another file, and reach the raw folder only when a run takes them."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.ingest import (
    INGESTED_EVENT,
    LOCK_NAME,
    RAW_DATA_RESOURCE,
    inbox_files,
    ingest_files,
    ingested_event,
    set_aside_rejected,
    take_inbox,
)
from flows.raw_data import raw_changes
from ppo_core.config import Config
from ppo_core.files import exclusive_run
from ppo_core.prompts import PromptFileError


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
    """Every file under ``folder``, hidden ones too (a part file left behind), relative to it;
    the inbox's lock file aside."""
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != LOCK_NAME
    )


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
    assert listing(project / "data" / "inbox") == []
    same = outside / "copy"
    same.mkdir()
    same_bytes = same / "prompts.jsonl"
    same_bytes.write_bytes((project / "data" / "raw" / "prompts.jsonl").read_bytes())
    assert ingest_files(Config(), [same_bytes]).added == []


def test_a_link_planted_where_the_copy_is_written_is_never_written_through(
    project, tmp_path_factory
):
    """The copy is written to a new file of a random name: links planted at every name a copy
    could have had before (``.NAME.<pid>.ingest-part.jsonl``) and at the final name's place
    leave their targets untouched."""
    outside = tmp_path_factory.mktemp("incoming")
    target = tmp_path_factory.mktemp("elsewhere") / "authorized_keys"
    target.write_text("ssh-ed25519 AAAA the owner's key\n")
    inbox = project / "data" / "inbox"
    inbox.mkdir(parents=True)
    (inbox / f".monday.{os.getpid()}.ingest-part.jsonl").symlink_to(target)
    result = ingest_files(Config(), [prompts_file(outside / "monday.jsonl", "a quiet story")])
    assert [p.name for p in result.added] == ["monday.jsonl"]
    assert target.read_text() == "ssh-ed25519 AAAA the owner's key\n"
    assert not (inbox / "monday.jsonl").is_symlink()
    # a link at the final name is a file of that name: refused, never replaced or followed
    (inbox / "tuesday.jsonl").symlink_to(target)
    with pytest.raises(PromptFileError, match="already exists with other content"):
        ingest_files(Config(), [prompts_file(outside / "tuesday.jsonl", "music and")])
    assert target.read_text() == "ssh-ed25519 AAAA the owner's key\n"


def test_two_ingests_of_one_name_at_once_add_one_file_and_refuse_the_other(
    project, tmp_path_factory
):
    """Both wait for the inbox's lock (held here, as by a third command); the first to get it
    adds its file, the second finds the name taken by other bytes and is refused."""
    first = prompts_file(tmp_path_factory.mktemp("one") / "news.jsonl", "first version")
    second = prompts_file(tmp_path_factory.mktemp("two") / "news.jsonl", "second version")
    outcomes: list[str] = []

    def ingest(path: Path) -> None:
        try:
            ingest_files(Config(), [path])
            outcomes.append(f"added {path.read_text()}")
        except PromptFileError as exc:
            outcomes.append(str(exc))

    inbox = project / "data" / "inbox"
    inbox.mkdir(parents=True)
    with exclusive_run(inbox / LOCK_NAME, "test"):
        threads = [threading.Thread(target=ingest, args=(path,)) for path in (first, second)]
        for thread in threads:
            thread.start()
        threads[0].join(0.5)
        assert outcomes == []  # both wait for the lock
    for thread in threads:
        thread.join(30)
    assert len(outcomes) == 2 and sum(o.startswith("added") for o in outcomes) == 1, outcomes
    assert any("already exists with other content" in o for o in outcomes), outcomes
    kept = (inbox / "news.jsonl").read_text()
    assert f"added {kept}" in outcomes


def test_only_regular_printable_files_within_the_size_limit_are_copied(project, tmp_path_factory):
    outside = tmp_path_factory.mktemp("incoming")
    config = Config()
    config.data.max_bytes_per_file = 1000
    big = prompts_file(outside / "big.jsonl", *["a long prompt of many words"] * 100)
    with pytest.raises(PromptFileError, match=r"big.jsonl: \d+ bytes, more than data.max_bytes"):
        ingest_files(config, [big])
    link = outside / "link.jsonl"
    link.symlink_to(prompts_file(outside / "real.jsonl", "fine"))
    with pytest.raises(PromptFileError, match="link.jsonl: a symbolic link"):
        ingest_files(config, [link])
    os.mkfifo(outside / "fifo.jsonl")
    with pytest.raises(PromptFileError, match="fifo.jsonl: not a regular file"):
        ingest_files(config, [outside / "fifo.jsonl"])
    for name in ("new\nline.jsonl", "escape\x1b[31m.jsonl"):
        odd = prompts_file(outside / name, "fine")
        with pytest.raises(PromptFileError, match="control characters") as refused:
            ingest_files(config, [odd])
        assert "\n" not in str(refused.value) and "\x1b" not in str(refused.value)
    assert listing(project / "data" / "inbox") == []  # nothing copied, no part file


def test_a_link_put_in_the_inbox_is_never_taken(project, tmp_path_factory):
    config = Config()
    secret = tmp_path_factory.mktemp("home") / "id_ed25519"
    secret.write_text('{"prompt": "-----BEGIN OPENSSH PRIVATE KEY-----"}\n')
    inbox = project / "data" / "inbox"
    inbox.mkdir(parents=True)
    (inbox / "planted.jsonl").symlink_to(secret)
    assert inbox_files(config) == []
    assert take_inbox(config) == []
    assert listing(project / "data" / "raw") == ["prompts.jsonl"]
    assert (inbox / "planted.jsonl").is_symlink()  # left where it is


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


def test_the_size_limit_refuses_before_a_byte_is_copied(project, tmp_path_factory):
    """The size check of the source itself (flows.ingest._checked_source), apart from the
    capped copy behind it."""
    from flows.ingest import _checked_source

    config = Config()
    config.data.max_bytes_per_file = 1000
    big = tmp_path_factory.mktemp("outside") / "big.jsonl"
    big.write_text('{"prompt": "a film"}\n' * 100)  # 2,100 bytes
    with pytest.raises(PromptFileError, match="2100 bytes, more than data.max_bytes_per_file=1000"):
        _checked_source(config, big)
