"""`ppo ingest` and the flow's inboxes: files (prompt files, and feedback files with
`--feedback`) are checked before anything is written, added whole or not at all, never replace
another file, and reach the raw (feedback) folder only when a run takes them."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.ingest import (
    FEEDBACK,
    FEEDBACK_INGESTED_EVENT,
    FEEDBACK_RESOURCE,
    INGESTED_EVENT,
    LOCK_NAME,
    PROMPTS,
    RAW_DATA_RESOURCE,
    Taken,
    inbox_files,
    ingest_files,
    ingested_event,
    set_aside_rejected,
    take_inbox,
    take_inboxes,
)
from flows.raw_data import feedback_changes, raw_changes
from ppo_core.config import Config
from ppo_core.feedback.fields import FeedbackFileError
from ppo_core.files import exclusive_run
from ppo_core.prompts import PromptFileError

ROOT = Path(__file__).resolve().parents[2]


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


def feedback_file(path: Path, pairs: int = 2, ratings: int = 1, start: int = 0) -> Path:
    """``pairs`` pair rows and ``ratings`` rating rows, each about its own prompt."""
    rows = [
        {"prompt": f"review {start + i}:", "chosen": "a warm, funny film", "rejected": "dull"}
        for i in range(pairs)
    ]
    rows += [
        {"prompt": f"rated {start + i}:", "response": "loved it", "rating": "up"}
        for i in range(ratings)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
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


def test_a_file_of_the_other_kind_than_its_folder_is_refused_as_prepare_would(
    project, tmp_path_factory
):
    """A chat file into a folder of plain prompts, and chat feedback beside plain pairs, pass
    each file's own check but make prepare fail on the folder, on every later run: ingest reads
    the new file with the folder (and the inbox) it joins and refuses, naming both files; nothing
    is added. Seen failing before (both were added)."""
    outside = tmp_path_factory.mktemp("incoming")
    chats = outside / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi?"}]}) + "\n")
    with pytest.raises(PromptFileError, match=r"chats.jsonl holds chat rows .*raw/prompts.jsonl"):
        ingest_files(Config(), [chats])
    assert listing(project / "data" / "inbox") == []
    plain = feedback_file(outside / "plain.jsonl", pairs=2, ratings=0)
    assert ingest_files(Config(), [plain], FEEDBACK).added  # waits in the feedback inbox
    chat_pairs = outside / "chat_pairs.jsonl"
    chat_pairs.write_text(
        json.dumps(
            {
                "messages": [{"role": "user", "content": "A film?"}],
                "chosen": "Yes.",
                "rejected": "-",
            }
        )
        + "\n"
    )
    with pytest.raises(FeedbackFileError, match="chat_pairs.jsonl holds chat rows"):
        ingest_files(Config(), [chat_pairs], FEEDBACK)
    assert listing(project / "data" / "inbox-feedback") == ["plain.jsonl"]


def test_rows_with_reference_fields_are_ingested_and_a_row_without_its_answer_is_not(
    project, tmp_path_factory
):
    """With ``data.reference_fields=[answer]`` ingest checks each row's answer as ``prepare``
    will read it: a file whose second row has none is refused naming the file, the line and
    the field, and nothing is added; a file whose rows all carry one is added."""
    from ppo_core.config import load_config

    config = load_config(overrides=["data.reference_fields=[answer]"])
    outside = tmp_path_factory.mktemp("incoming")
    bad = outside / "problems.jsonl"
    bad.write_text('{"prompt": "2 + 2 =", "answer": "4"}\n{"prompt": "3 + 3 ="}\n')
    with pytest.raises(PromptFileError, match=rf"{bad}:2: reference field 'answer' is missing"):
        ingest_files(config, [bad])
    assert listing(project / "data" / "inbox") == []
    good = outside / "more.jsonl"
    good.write_text('{"prompt": "2 + 2 =", "answer": "4"}\n{"prompt": "3 + 3 =", "answer": 6}\n')
    assert ingest_files(config, [good]).prompts == {"more.jsonl": 2}


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


@pytest.mark.parametrize("inbox", [PROMPTS, FEEDBACK], ids=["prompts", "feedback"])
def test_only_regular_printable_files_within_the_size_limit_are_copied(
    project, tmp_path_factory, inbox
):
    outside = tmp_path_factory.mktemp("incoming")
    config = Config()
    config.data.max_bytes_per_file = 1000
    big = prompts_file(outside / "big.jsonl", *["a long prompt of many words"] * 100)
    with pytest.raises(PromptFileError, match=r"big.jsonl: \d+ bytes, more than data.max_bytes"):
        ingest_files(config, [big], inbox)
    link = outside / "link.jsonl"
    link.symlink_to(feedback_file(outside / "real.jsonl"))
    with pytest.raises(PromptFileError, match="link.jsonl: a symbolic link"):
        ingest_files(config, [link], inbox)
    os.mkfifo(outside / "fifo.jsonl")
    with pytest.raises(PromptFileError, match="fifo.jsonl: not a regular file"):
        ingest_files(config, [outside / "fifo.jsonl"], inbox)
    (outside / "notes.txt").write_text("hello")
    with pytest.raises(PromptFileError, match="reads only .jsonl and .parquet"):
        ingest_files(config, [outside / "notes.txt"], inbox)
    for name in ("new\nline.jsonl", "escape\x1b[31m.jsonl"):
        odd = feedback_file(outside / name)
        with pytest.raises(PromptFileError, match="control characters") as refused:
            ingest_files(config, [odd], inbox)
        assert "\n" not in str(refused.value) and "\x1b" not in str(refused.value)
    # nothing copied, no part file, in either inbox
    assert listing(project / "data" / "inbox") == []
    assert listing(project / "data" / "inbox-feedback") == []


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


# --- feedback: `ppo ingest --feedback` -----------------------------------------------------


def test_feedback_is_ingested_into_its_own_inbox(project, tmp_path_factory):
    outside = tmp_path_factory.mktemp("incoming")
    ratings = feedback_file(outside / "ratings.jsonl", pairs=2, ratings=3)
    result = ingest_files(Config(), [ratings], FEEDBACK)
    assert [p.name for p in result.added] == ["ratings.jsonl"]
    assert (result.pairs, result.ratings) == ({"ratings.jsonl": 2}, {"ratings.jsonl": 3})
    assert result.holds("ratings.jsonl") == "2 pairs, 3 ratings"
    assert listing(project / "data" / "inbox-feedback") == ["ratings.jsonl"]
    assert (project / "data" / "inbox-feedback" / "ratings.jsonl").read_bytes() == (
        ratings.read_bytes()
    )
    assert not (project / "data" / "inbox").exists()  # the prompt inbox is another folder
    assert not (project / "data" / "feedback").exists()  # a run moves it there, not ingest
    # The same bytes again: nothing to add; another file of that name: refused.
    again = ingest_files(Config(), [ratings], FEEDBACK)
    assert again.added == [] and [p.name for p in again.already_there] == ["ratings.jsonl"]
    other = feedback_file(tmp_path_factory.mktemp("other") / "ratings.jsonl", pairs=1)
    with pytest.raises(FeedbackFileError, match="already exists with other content"):
        ingest_files(Config(), [other], FEEDBACK)
    # A name taken in data.feedback_dir counts as well.
    (project / "data" / "feedback").mkdir()
    (project / "data" / "feedback" / "old.jsonl").write_bytes(other.read_bytes())
    kept = feedback_file(outside / "old.jsonl", pairs=1, ratings=0)
    with pytest.raises(FeedbackFileError, match="data/feedback/old.jsonl already exists"):
        ingest_files(Config(), [kept], FEEDBACK)
    assert listing(project / "data" / "inbox-feedback") == ["ratings.jsonl"]

    # The command: with --feedback, what each file holds; without a server, no event.
    pairs = feedback_file(outside / "pairs.jsonl", pairs=1, ratings=1, start=10)
    done = CliRunner().invoke(app, ["ingest", "--feedback", str(pairs)])
    assert done.exit_code == 0, done.output
    assert "added data/inbox-feedback/pairs.jsonl (1 pair, 1 rating)" in done.output
    assert "PREFECT_API_URL is not set, so no run was triggered" in done.output
    done = CliRunner().invoke(app, ["ingest", "--feedback", str(pairs)])
    assert "already holds these bytes: nothing to add" in done.output


def test_a_malformed_feedback_file_is_refused_naming_file_and_line_and_nothing_is_copied(
    project, tmp_path_factory
):
    outside = tmp_path_factory.mktemp("incoming")
    good = feedback_file(outside / "good.jsonl")
    bad = outside / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"})
        + "\n"
        + json.dumps({"prompt": "a", "response": "b", "rating": "meh"})
        + "\n"
    )
    with pytest.raises(FeedbackFileError, match=rf"^{bad} line 2: 'rating' is the unknown word"):
        ingest_files(Config(), [good, bad], FEEDBACK)
    assert listing(project / "data" / "inbox-feedback") == []  # neither file, no part file

    done = CliRunner().invoke(app, ["ingest", "--feedback", str(good), str(bad)])
    assert done.exit_code == 2, done.output
    [line] = done.output.strip().splitlines()
    assert line.startswith(f"error: {bad} line 2: 'rating' is the unknown word 'meh'"), line
    assert listing(project / "data" / "inbox-feedback") == []

    empty = outside / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(FeedbackFileError, match="empty.jsonl: no feedback"):
        ingest_files(Config(), [empty], FEEDBACK)
    assert listing(project / "data" / "inbox-feedback") == []


def test_a_prompt_file_passed_as_feedback_is_refused(project, tmp_path_factory):
    prompts = prompts_file(tmp_path_factory.mktemp("incoming") / "prompts2.jsonl", "the film")
    with pytest.raises(FeedbackFileError, match=rf"^{prompts} line 1: neither a pair"):
        ingest_files(Config(), [prompts], FEEDBACK)
    done = CliRunner().invoke(app, ["ingest", "--feedback", str(prompts)])
    assert done.exit_code == 2, done.output
    assert f"error: {prompts} line 1: neither a pair (chosen and rejected)" in done.output
    assert listing(project / "data" / "inbox-feedback") == []
    assert listing(project / "data" / "inbox") == []


def test_a_run_takes_both_inboxes_and_counts_new_feedback_as_new_data(project, tmp_path_factory):
    """The take step moves feedback into data.feedback_dir; `new_data_only` sees it as new
    until a prepared version records it (a real `prepare`, whose feedback manifest
    `flows.raw_data.feedback_changes` reads)."""
    from flows.stages import prepare

    outside = tmp_path_factory.mktemp("incoming")
    config = Config()
    config.data.train_file = "data/interim/train.parquet"  # the prepared version: prepare's
    prompts_file(project / "data" / "raw" / "prompts.jsonl", *[f"prompt {i}" for i in range(40)])
    (project / "data" / "feedback").mkdir()
    feedback_file(project / "data" / "feedback" / "first.jsonl", pairs=4, ratings=0)
    prepare(config)
    assert raw_changes(config) == [] and feedback_changes(config) == []

    ingest_files(config, [feedback_file(outside / "second.jsonl", start=100)], FEEDBACK)
    assert feedback_changes(config) == []  # waiting in the inbox: not yet data
    taken = take_inboxes(config)
    assert taken == Taken(prompts=[], feedback=["second.jsonl"]) and taken
    assert listing(project / "data" / "feedback") == ["first.jsonl", "second.jsonl"]
    assert inbox_files(config, FEEDBACK) == []
    assert feedback_changes(config) == ["new feedback second.jsonl"]
    assert raw_changes(config) == []
    assert not take_inboxes(config)  # nothing waits any more

    # Both inboxes at once; a name taken by other bytes in either stops both, moving nothing.
    ingest_files(config, [prompts_file(outside / "more.jsonl", "a new prompt")])
    ingest_files(config, [feedback_file(outside / "third.jsonl", start=200)], FEEDBACK)
    (project / "data" / "feedback" / "third.jsonl").write_text("put there by hand\n")
    with pytest.raises(FeedbackFileError, match="third.jsonl now holds other content"):
        take_inboxes(config)
    assert [p.name for p in inbox_files(config)] == ["more.jsonl"]
    assert [p.name for p in inbox_files(config, FEEDBACK)] == ["third.jsonl"]
    (project / "data" / "feedback" / "third.jsonl").unlink()
    taken = take_inboxes(config)
    assert taken == Taken(prompts=["more.jsonl"], feedback=["third.jsonl"])
    assert sorted(feedback_changes(config)) == [
        "new feedback second.jsonl",
        "new feedback third.jsonl",
    ]
    assert raw_changes(config) == ["new more.jsonl"]


def test_a_rejected_run_sets_its_feedback_aside_too(project, tmp_path_factory):
    outside = tmp_path_factory.mktemp("incoming")
    config = Config()
    (project / "data" / "feedback").mkdir()
    feedback_file(project / "data" / "feedback" / "kept.jsonl")
    before = listing(project / "data" / "feedback")
    # one name in both inboxes: the two files are set aside side by side
    ingest_files(config, [prompts_file(outside / "monday.jsonl", "x")])
    ingest_files(config, [feedback_file(outside / "monday.jsonl")], FEEDBACK)
    taken = take_inboxes(config)
    assert taken.names() == ["monday.jsonl", "feedback/monday.jsonl"]
    folder = set_aside_rejected(config, taken.prompts, "min_train_pairs failed", taken.feedback)
    assert (project / folder).parent == project / "data" / "rejected"
    assert listing(folder) == ["REASON.txt", "feedback/monday.jsonl", "monday.jsonl"]
    assert listing(project / "data" / "feedback") == before
    assert listing(project / "data" / "raw") == ["prompts.jsonl"]
    # a run that took feedback alone
    ingest_files(config, [feedback_file(outside / "tuesday.jsonl", start=5)], FEEDBACK)
    taken = take_inboxes(config)
    assert taken.prompts == [] and taken
    folder = set_aside_rejected(config, taken.prompts, "failed", taken.feedback)
    assert listing(folder) == ["REASON.txt", "feedback/tuesday.jsonl"]
    assert listing(project / "data" / "feedback") == before


@pytest.mark.parametrize(
    ("inbox", "deployment", "payload"),
    [
        (PROMPTS, "on-new-data", {"files": ["extra.jsonl"], "prompts": 2}),
        (FEEDBACK, "on-new-feedback", {"files": ["extra.jsonl"], "pairs": 2, "ratings": 1}),
    ],
    ids=["prompts", "feedback"],
)
def test_each_event_starts_its_own_deployment_of_prefect_yaml(
    project, tmp_path_factory, inbox, deployment, payload
):
    outside = tmp_path_factory.mktemp("incoming")
    extra = (
        feedback_file(outside / "extra.jsonl")
        if inbox == FEEDBACK
        else prompts_file(outside / "extra.jsonl", "a", "b")
    )
    event = ingested_event(ingest_files(Config(), [extra], inbox), project)
    assert event["event"] == inbox.event
    assert event["resource"]["prefect.resource.id"] == inbox.resource
    assert event["payload"] == payload  # file names and counts, for people
    assert (FEEDBACK.event, FEEDBACK.resource) == (FEEDBACK_INGESTED_EVENT, FEEDBACK_RESOURCE)
    assert (PROMPTS.event, PROMPTS.resource) == (INGESTED_EVENT, RAW_DATA_RESOURCE)
    assert inbox.deployment == f"retrain/{deployment}"
    import yaml

    declared = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    spec = next(d for d in declared if d["name"] == deployment)
    [trigger] = [t for t in spec["triggers"] if inbox.event in t["expect"]]
    assert trigger["match"] == {"prefect.resource.id": inbox.resource}
    assert trigger["expect"] == [inbox.event]
    assert "parameters" not in trigger  # the run reads the inboxes, not the event
    # no other deployment starts on this event
    others = [d["name"] for d in declared for t in d["triggers"] if inbox.event in t["expect"]]
    assert others == [deployment]
    assert spec["parameters"] == {"from_production": True, "new_data_only": True, "backup": True}
    assert spec["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
    assert spec["work_pool"]["name"] == "ppo"
    [resume] = [t for t in spec["triggers"] if t["expect"] == ["prefect.flow-run.Crashed"]]
    names = {related["prefect.resource.name"] for related in resume["match_related"]}
    assert names == {"retrain", deployment}
