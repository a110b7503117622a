"""Entries of data.raw_dir that are not prompt files: a FIFO, a link to /dev/zero, a folder, a
dangling link. Reading one would block or never end; `ppo prepare`, `ppo train`'s stale-data
check and the flow's new-data check all refuse it first, saying what it is."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from flows.raw_data import raw_changes
from flows.stages import prepare
from ppo_core.config import load_config
from ppo_core.prompts import PromptFileError


@contextlib.contextmanager
def at_most(seconds: int):
    """Fail instead of hanging: a read of a FIFO or /dev/zero would not come back."""

    def stop(*_):
        raise TimeoutError(f"still reading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def plant(folder, kind: str):
    entry = folder / "zz.jsonl"
    if kind == "a FIFO":
        os.mkfifo(entry)
    elif kind == "a character device (through a link)":
        entry.symlink_to("/dev/zero")
    elif kind == "a folder":
        entry.mkdir()
    else:
        entry.symlink_to(folder / "gone.jsonl")


KINDS = ["a FIFO", "a character device (through a link)", "a folder", "a link to nothing"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_entry_that_is_not_a_file_is_refused_by_what_it_is(tmp_path, kind):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "prompts.jsonl").write_text('{"prompt": "a film review"}\n')
    plant(raw, kind)
    config = load_config(
        overrides=[
            f"data.raw_dir={raw}",
            f"data.interim_dir={tmp_path / 'interim'}",
            f"data.train_file={tmp_path / 'prepared' / 'train.parquet'}",
        ]
    )
    for reader in (prepare, raw_changes):  # raw_changes: train's and the flow's check
        with at_most(20), pytest.raises(PromptFileError) as refused:
            reader(config)
        assert str(refused.value).startswith(f"{raw / 'zz.jsonl'} is {kind}, not a prompt file")
    assert not (tmp_path / "interim").exists()
