"""File safety: atomic files and folders leave the old version or the new one, never a mixture,
and the run lock refuses a second run without ever writing through a link."""

from __future__ import annotations

import os
import stat
import time

import pytest

from ppo_core.files import (
    OUTPUT_MARKER,
    ForeignFolderError,
    RunLockedError,
    UnsafeCopyError,
    atomic_folder,
    atomic_write_text,
    copy_regular_tree,
    copying,
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
    assert sorted(p.name for p in target.iterdir()) == [OUTPUT_MARKER, "b.txt"]


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
    (old / OUTPUT_MARKER).write_text("")  # it had passed as an output before it was hidden

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


# --- an output folder replaces only what the pipeline wrote ----------------------------------


def test_atomic_folder_marks_what_it_writes(tmp_path):
    target = atomic_folder(tmp_path / "out", lambda tmp: (tmp / "a.txt").write_text("v1"))
    assert (target / OUTPUT_MARKER).is_file()
    # a writer's own file of that name (a copied output) is replaced, never written through
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    atomic_folder(target, lambda tmp: (tmp / OUTPUT_MARKER).symlink_to(victim))
    assert not (target / OUTPUT_MARKER).is_symlink() and victim.read_text() == "keep me"


def test_atomic_folder_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    target = tmp_path / "notes"
    target.mkdir()
    (target / "todo.txt").write_text("keep me")
    written = []
    with pytest.raises(ForeignFolderError) as raised:
        atomic_folder(target, written.append)
    message = str(raised.value)
    assert str(target) in message and "move it away or choose another" in message
    assert "\n" not in message and isinstance(raised.value, FileExistsError)
    assert written == []  # refused before anything was written
    assert [p.name for p in target.iterdir()] == ["todo.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["notes"]


def test_atomic_folder_refuses_a_folder_that_appears_while_it_writes(tmp_path):
    target = tmp_path / "out"

    def write(tmp):
        (tmp / "a.txt").write_text("new")
        target.mkdir()  # someone else's folder, made meanwhile
        (target / "theirs.txt").write_text("keep me")

    with pytest.raises(ForeignFolderError):
        atomic_folder(target, write)
    assert [p.name for p in target.iterdir()] == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_atomic_folder_replaces_an_empty_folder(tmp_path):
    (tmp_path / "out").mkdir()
    atomic_folder(tmp_path / "out", lambda tmp: (tmp / "a.txt").write_text("v1"))
    assert (tmp_path / "out" / "a.txt").read_text() == "v1"


@pytest.mark.parametrize(
    "names",
    [
        ("manifest.json", "train.parquet", "eval.parquet"),  # data/interim, data/prepared
        ("tiny_default.json", "config.json"),  # models/base built by `ppo base`
        ("imported_from.json", "config.json"),  # models/base imported by `ppo base`
        ("training_summary.json", "config.json"),  # models/candidate
        ("trainer_state.json", "checksums.json", "optimizer.pt"),  # checkpoints/step-*
        ("metrics.json", "report.md", "samples.json"),  # reports/eval
        ("metrics.json",),  # reports/eval in a fresh clone: git keeps this file alone
    ],
)
def test_outputs_of_earlier_versions_without_a_marker_are_replaced(tmp_path, names):
    target = tmp_path / "out"
    target.mkdir()
    for name in names:
        (target / name).write_text("old")
    atomic_folder(target, lambda tmp: (tmp / "a.txt").write_text("new"))
    assert sorted(p.name for p in target.iterdir()) == [OUTPUT_MARKER, "a.txt"]


def test_a_folder_with_a_metrics_file_among_others_is_not_an_earlier_output(tmp_path):
    target = tmp_path / "experiments"
    target.mkdir()
    (target / "metrics.json").write_text("{}")
    (target / "notes.md").write_text("keep me")
    with pytest.raises(ForeignFolderError):
        atomic_folder(target, lambda tmp: (tmp / "a.txt").write_text("new"))
    assert sorted(p.name for p in target.iterdir()) == ["metrics.json", "notes.md"]


@pytest.mark.parametrize("kind", ["file", "link to a folder", "dangling link"])
def test_atomic_folder_refuses_to_replace_what_is_not_a_folder(tmp_path, kind):
    target, real = tmp_path / "out", tmp_path / "real"
    real.mkdir()
    (real / "keep.txt").write_text("keep me")
    if kind == "file":
        target.write_text("keep me")
    elif kind == "link to a folder":
        target.symlink_to(real)
    else:
        target.symlink_to(tmp_path / "missing")
    with pytest.raises(ForeignFolderError, match="move it away or choose another"):
        atomic_folder(target, lambda tmp: (tmp / "a.txt").write_text("new"))
    assert target.is_symlink() or target.read_text() == "keep me"
    assert (real / "keep.txt").read_text() == "keep me"


# --- copies of model folders: regular files only, within a cap ----------------------------


def test_copy_regular_tree_copies_files_and_folders(tmp_path):
    source = tmp_path / "model"
    (source / "sub" / "deeper").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "deeper" / "w.bin").write_bytes(b"x" * 3_000_000)
    (source / "empty").mkdir()
    (source / "config.json").chmod(0o640)
    dest = tmp_path / "copy"
    dest.mkdir()
    listing = copy_regular_tree(source, dest)
    assert listing == [("config.json", 2), ("sub/deeper/w.bin", 3_000_000)]
    assert (dest / "sub" / "deeper" / "w.bin").read_bytes() == b"x" * 3_000_000
    assert (dest / "empty").is_dir()
    assert stat.S_IMODE((dest / "config.json").stat().st_mode) == 0o640


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        ("link to a private file", "is a symbolic link"),
        ("link to /dev/zero", "is a symbolic link"),
        ("link to a folder", "is a symbolic link"),
        ("fifo", "is a FIFO"),
        ("socket", "is a socket"),
    ],
)
def test_copy_regular_tree_refuses_links_and_special_files(tmp_path, kind, what):
    source = tmp_path / "model"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    entry = source / "sub" / "entry"
    secret = tmp_path / "id_rsa"
    secret.write_text("private")
    if kind == "link to a private file":
        entry.symlink_to(secret)
    elif kind == "link to /dev/zero":
        entry.symlink_to("/dev/zero")
    elif kind == "link to a folder":
        entry.symlink_to(tmp_path)
    elif kind == "fifo":
        os.mkfifo(entry)
    else:
        import socket

        server = socket.socket(socket.AF_UNIX)
        short = f"/tmp/ppo-test-{os.getpid()}.sock"  # socket paths are short
        server.bind(short)
        os.rename(short, entry)
        server.close()
    dest = tmp_path / "copy"
    dest.mkdir()
    started = time.monotonic()
    with pytest.raises(UnsafeCopyError, match=f"sub/entry {what}") as raised:
        copy_regular_tree(source, dest)
    assert time.monotonic() - started < 5
    assert isinstance(raised.value, FileExistsError) and "\n" not in str(raised.value)
    assert list(dest.iterdir()) == []  # refused before anything was copied


def test_copy_regular_tree_refuses_over_the_cap_before_copying(tmp_path, monkeypatch):
    source = tmp_path / "model"
    source.mkdir()
    (source / "a.bin").write_bytes(b"x" * 600)
    (source / "b.bin").write_bytes(b"x" * 600)
    dest = tmp_path / "copy"
    dest.mkdir()
    with pytest.raises(UnsafeCopyError, match="1200 bytes, more than the 1000 bytes"):
        copy_regular_tree(source, dest, max_bytes=1000)
    assert list(dest.iterdir()) == []
    monkeypatch.setattr(copying, "MAX_COPY_BYTES", 1000)  # the default cap is read at each call
    with pytest.raises(UnsafeCopyError, match="more than the 1000 bytes"):
        copy_regular_tree(source, dest)
    assert copying.MAX_COPY_BYTES == 1000
    monkeypatch.undo()
    assert copying.MAX_COPY_BYTES >= 200 * 10**9
    assert copy_regular_tree(source, dest) == [("a.bin", 600), ("b.bin", 600)]


def test_copy_regular_tree_refuses_a_file_that_grows_while_it_is_copied(tmp_path, monkeypatch):
    source = tmp_path / "model"
    source.mkdir()
    grower = source / "a.bin"
    grower.write_bytes(b"x" * 100)
    real_scan = copying._scan

    def scan_then_grow(folder, max_bytes, link_root=None):
        found = real_scan(folder, max_bytes, link_root)
        with grower.open("ab") as handle:  # a writer appends after the check
            handle.write(b"y" * 100)
        return found

    monkeypatch.setattr(copying, "_scan", scan_then_grow)
    dest = tmp_path / "copy"
    dest.mkdir()
    with pytest.raises(UnsafeCopyError, match="changed while it was copied"):
        copy_regular_tree(source, dest)
