"""File safety: atomic files and folders leave the old version or the new one, never a mixture,
and the run lock refuses a second run without ever writing through a link."""

from __future__ import annotations

import os
import stat

import pytest

from ppo_core.files import (
    RunLockedError,
    atomic_folder,
    atomic_write_text,
    discard,
    exclusive_run,
    file_sha256,
    first_line,
    is_partial,
)


def test_atomic_folder_keeps_the_old_version_on_failure(tmp_path):
    target = tmp_path / "out"
    atomic_folder(target, lambda tmp: (tmp / "a.txt").write_text("v1"))

    def failing(tmp):
        (tmp / "a.txt").write_text("v2-partial")
        raise RuntimeError("crash while writing")

    with pytest.raises(RuntimeError, match="crash"):
        atomic_folder(target, failing)
    assert (target / "a.txt").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left behind
    atomic_folder(target, lambda tmp: (tmp / "b.txt").write_text("v2"))
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]


def test_atomic_folder_reports_a_foreign_full_disk_as_oserror(tmp_path):
    def safetensors_like(tmp):
        raise RuntimeError("I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError, match="No space left") as raised:
        atomic_folder(tmp_path / "model", safetensors_like)
    assert raised.value.errno == 28 and list(tmp_path.iterdir()) == []


def test_an_interrupted_swap_is_undone_by_the_next_writer(tmp_path):
    # A writer killed between its two renames: the target is gone, the old version hidden.
    old = tmp_path / f".out.old-{2**22 + 12345}"  # a pid no process has
    old.mkdir()
    (old / "a.txt").write_text("v1")

    def check_and_write(tmp):
        assert (tmp_path / "out" / "a.txt").read_text() == "v1"  # restored before writing
        (tmp / "a.txt").write_text("v2")

    atomic_folder(tmp_path / "out", check_and_write)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (tmp_path / "out" / "a.txt").read_text() == "v2"


def test_discard_hides_the_folder_first(tmp_path):
    (tmp_path / "step-000002").mkdir()
    (tmp_path / "step-000002" / "x").write_text("x")
    discard(tmp_path / "step-000002")
    assert list(tmp_path.iterdir()) == []


def test_partial_names():
    assert is_partial(".step-000004.tmp-k2j3", "step-")
    assert is_partial(".step-000004.old-123", "step-") and is_partial(".out.discard-9")
    assert not is_partial("step-000004", "step-") and not is_partial(".out.tmp-1", "step-")
    assert not is_partial(".gitignore")


def test_atomic_write_text_replaces_and_keeps_the_mode(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("old\n")
    path.chmod(0o640)
    atomic_write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["params.yaml"]
    atomic_write_text(tmp_path / "sub" / "new.json", "{}")  # creates the folder
    assert (tmp_path / "sub" / "new.json").read_text() == "{}"


def test_a_failed_atomic_write_changes_nothing(tmp_path):
    path = tmp_path / "registry.json"
    path.write_text("before")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(path, "é", encoding="ascii")
    assert path.read_text() == "before"
    assert [p.name for p in tmp_path.iterdir()] == ["registry.json"]


def test_atomic_write_text_ignores_a_planted_temporary_name(tmp_path):
    # A fixed temporary name could be a link planted by someone else; names are unique and new.
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / ".params.yaml.tmp").symlink_to(victim)
    atomic_write_text(tmp_path / "params.yaml", "a: 1\n")
    assert victim.read_text() == "keep me"
    assert (tmp_path / "params.yaml").read_text() == "a: 1\n"


def test_hash_and_first_line(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    # SHA-256("abc"), FIPS 180-2 appendix B.1
    assert file_sha256(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert first_line(ValueError("one\ntwo")) == "one"
    assert first_line(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
    lock = tmp_path / "run.lock"
    with exclusive_run(lock, "training run"):
        holder = lock.read_text()
        assert holder.startswith(f"pid {os.getpid()} since ")
        refused = pytest.raises(
            RunLockedError, match=rf"another training run is running \(pid {os.getpid()}"
        )
        with refused, exclusive_run(lock, "training run"):
            pass
        assert lock.read_text() == holder  # the refused run truncated nothing
    with exclusive_run(lock, "training run"):  # free again after the holder leaves
        pass


def test_the_lock_never_writes_through_a_link(tmp_path):
    victim = tmp_path / "params.yaml"
    victim.write_text("seed: 0\n")
    (tmp_path / "sym.lock").symlink_to(victim)
    with (
        pytest.raises(FileExistsError, match="symbolic link"),
        exclusive_run(tmp_path / "sym.lock", "training run"),
    ):
        pass
    os.link(victim, tmp_path / "hard.lock")
    with (
        pytest.raises(FileExistsError, match="hard link"),
        exclusive_run(tmp_path / "hard.lock", "training run"),
    ):
        pass
    assert victim.read_text() == "seed: 0\n"
