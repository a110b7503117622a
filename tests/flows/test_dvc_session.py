"""One DVC process runs the commands of a run (flows/orchestration/dvc_session.py): its output, exit codes,
deadlines, and what happens after a command that failed or was stopped."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from flows.orchestration.dvc_session import (
    _AHEAD,
    FIRST_MODULES,
    LATER_MODULES,
    DvcSession,
    run_folder,
    start_ahead,
    take,
)
from flows.orchestration.relay import CommandTimedOut, StageRelay, stage_environment
from tests.flows.conftest import HANGING, Recorder


def dvc_project(tmp_path, stages: str):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([Path(sys.executable).parent / "dvc", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(stages)
    return tmp_path


TWO_STAGES = """stages:
  hello:
    cmd: python -c "print('hello from the stage'); open('out.txt', 'w').write('hi')"
    outs:
      - out.txt
  broken:
    cmd: python -c "import sys; print('about to fail'); sys.exit(3)"
"""


def test_commands_share_one_process_and_each_ends_with_its_exit_code(tmp_path):
    project = dvc_project(tmp_path, TWO_STAGES)
    with DvcSession(str(project), stage_environment()) as session:
        first = Recorder()
        assert session.run(["repro", "--single-item", "hello"], StageRelay("hello", first)) == 0
        assert session.process is not None
        pid = session.process.pid
        lines = first.at(20)
        assert "Running stage 'hello':" in lines and "hello from the stage" in lines
        assert (project / "out.txt").read_text() == "hi"

        again = StageRelay("hello", Recorder())
        assert session.run(["repro", "--single-item", "hello"], again) == 0
        assert again.skipped  # the second call saw the first one's dvc.lock

        failed = Recorder()
        code = session.run(["repro", "--single-item", "broken"], StageRelay("broken", failed))
        assert code != 0
        assert "about to fail" in failed.at(20)
        # An argument DVC refuses is an exit code too; the session goes on.
        assert session.run(["repro", "--no-such-flag"], StageRelay("x", Recorder())) != 0
        assert session.run(["status"], StageRelay("x", Recorder())) == 0
        assert session.process is not None and session.process.pid == pid
    assert session.process is None


def test_a_command_past_its_deadline_is_stopped_and_the_next_one_starts_afresh(tmp_path):
    import psutil

    (tmp_path / "hang.py").write_text(HANGING)
    project = dvc_project(tmp_path, "stages:\n  hang:\n    cmd: python hang.py\n")
    with DvcSession(str(project), stage_environment()) as session:
        log = Recorder()
        with pytest.raises(CommandTimedOut, match="ran longer than 8 s"):
            session.run(["repro", "hang"], StageRelay("hang", log), timeout=8)
        assert session.process is None
        child_pid = int(log.at(20)[-1])
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
        assert session.run(["status"], StageRelay("x", Recorder())) == 0


def test_outside_a_dvc_repository_the_command_fails_and_says_why(tmp_path):
    with DvcSession(str(tmp_path), stage_environment()) as session:
        log = Recorder()
        assert session.run(["repro", "train"], StageRelay("train", log)) != 0
    assert any("not inside of a DVC repo" in line for line in log.at(20))


def test_a_command_whose_process_dies_fails_and_the_next_one_starts_afresh(tmp_path):
    # The stage's shell kills DVC under it, as the out-of-memory killer might.
    project = dvc_project(tmp_path, "stages:\n  die:\n    cmd: kill -9 $PPID\n")
    with DvcSession(str(project), stage_environment()) as session:
        assert session.run(["repro", "die"], StageRelay("die", Recorder())) != 0
        assert session.process is None
        assert session.run(["status"], StageRelay("x", Recorder())) == 0


def session_ahead(project: str) -> DvcSession:
    return _AHEAD[project]


def test_a_session_started_ahead_is_taken_by_the_run_it_was_started_for(tmp_path):
    project = str(dvc_project(tmp_path, TWO_STAGES))
    env = stage_environment() | {"PPO_PROJECT_DIR": project}
    start_ahead(project, env)
    session = take(project, env)
    try:
        assert session.process is not None and session.process.poll() is None
        pid = session.process.pid
        assert (
            session.run(["repro", "--single-item", "hello"], StageRelay("hello", Recorder())) == 0
        )
        assert session.process.pid == pid  # the process started ahead ran the command
    finally:
        session.close()
    # Started ahead with another environment (or for another folder), it is not taken: the
    # run gets a process of its own, and the other one is ended.
    start_ahead(project, env)
    ahead = session_ahead(project)
    other = take(project, env | {"PPO_PROJECT_DIR": "/elsewhere"})
    try:
        assert other is not ahead and ahead.process is None
        assert other.process is not None and other.process.poll() is None
    finally:
        other.close()


@pytest.mark.parametrize(
    ("argv", "folder"),
    [
        (["run"], "."),
        (["run", "--repo", "sub"], "sub"),
        (["run", "--from-production", "--repo=sub"], "sub"),
        (["run", "--help"], None),
        (["serve", "--repo", "sub"], None),
        ([], None),
    ],
)
def test_the_folder_of_a_run_is_read_from_its_arguments(argv, folder, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    expected = None if folder is None else str((tmp_path / folder).resolve())
    assert run_folder(argv) == expected


def test_the_modules_imported_ahead_exist_in_the_installed_dvc():
    """A DVC release that moves one of them would quietly lose the head start."""
    import importlib.util

    missing = [m for m in (*FIRST_MODULES, *LATER_MODULES) if importlib.util.find_spec(m) is None]
    assert not missing, f"not in this DVC: {missing}"
