"""What the flow makes of a stage's output (live lines, progress bars, DVC's advice, warnings)
and how it words the promotion decision, without a Prefect server."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from flows.orchestration.outcome import decision_message, summary
from flows.orchestration.relay import Deadline, StageRelay, output_segments, stop_process_tree
from flows.orchestration.relay import stage_environment as _environment
from flows.pipeline import StageFailed, run_stage
from tests.flows.conftest import HANGING, Recorder


def relay_command(
    command: list[str],
    cwd: str,
    env: dict[str, str],
    relay: StageRelay,
    timeout: float | None = None,
) -> int:
    """Run ``command`` with its output (stderr merged into stdout, in order) fed to ``relay``
    as it arrives, as :class:`flows.orchestration.dvc_session.DvcSession` feeds a stage's; returns the exit
    code.

    With ``timeout`` (seconds, > 0), the command's process tree is stopped when it runs longer
    and :class:`CommandTimedOut` is raised once its output has ended.
    """
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert process.stdout is not None
    deadline = Deadline(process, timeout)
    try:
        with process.stdout:
            for text, finished in output_segments(process.stdout, deadline.stopped):
                relay.feed(text, finished)
    except BaseException:
        # Cancelled or interrupted: the stage's processes get the chance to stop cleanly, and
        # DVC to release its lock.
        stop_process_tree(process.pid)
        raise
    finally:
        deadline.cancel()
    returncode = process.wait()
    deadline.check()
    return returncode


def test_a_stage_s_lines_reach_the_log_while_it_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # as in a plain shell
    log = Recorder()
    script = "import time; print('first'); time.sleep(1.5); print('second')"
    code = relay_command(
        [sys.executable, "-c", script], str(tmp_path), _environment(), StageRelay("x", log)
    )
    assert code == 0
    (first, _, text1), (second, _, text2) = log.records
    assert (text1, text2) == ("first", "second")
    # The first line was logged as it was printed, not when the process ended.
    assert second - first >= 1.0


def test_output_is_cut_at_line_ends_and_carriage_returns(tmp_path):
    raw = tmp_path / "out"
    raw.write_bytes("a\r\nb\rc\r\rd\né\n\rlast".encode())
    with raw.open("rb") as stream:
        assert list(output_segments(stream)) == [
            ("a", True),
            ("b", False),
            ("c", False),
            ("", False),
            ("d", True),
            ("é", True),
            ("", False),
            ("last", True),
        ]


def test_a_progress_bar_is_logged_every_interval_and_a_short_one_at_debug():
    now = [0.0]
    log = Recorder()
    relay = StageRelay("train", log, progress_every=10.0, clock=lambda: now[0])
    for second in range(26):  # a bar redrawn every second for 25 s
        now[0] = float(second)
        relay.feed(f"PPO {second}/25", finished=False)
    relay.feed("PPO 25/25 done", finished=True)
    relay.feed("", finished=False)  # tqdm: \r, two quick states, then \n
    relay.feed("Loading weights: 0%", finished=False)
    relay.feed("Loading weights: 100%", finished=True)
    relay.feed("trained 25 iterations", finished=True)
    assert log.at(logging.INFO) == ["PPO 10/25", "PPO 20/25", "PPO 25/25 done", *relay.tail]
    assert log.at(logging.DEBUG) == ["Loading weights: 100%"]
    assert list(relay.tail) == ["trained 25 iterations"]


# What `dvc repro --single-item train` prints after a stage that changed dvc.lock.
DVC_OUTPUT = """Running stage 'train':
> ppo train --quiet --config params.yaml
Updating lock file 'dvc.lock'

To track the changes with git, run:

\tgit add dvc.lock models/.gitignore

To enable auto staging, run:

\tdvc config core.autostage true
Use `dvc push` to send your updates to remote storage.
git add is how a stage may say it, too
trained 2 iterations"""


def test_dvc_s_git_add_advice_is_kept_back_and_its_files_noted():
    log = Recorder()
    relay = StageRelay("train", log)
    for line in DVC_OUTPUT.splitlines():
        relay.feed(line, finished=True)
    assert log.at(logging.INFO) == [
        "Running stage 'train':",
        "> ppo train --quiet --config params.yaml",
        "Updating lock file 'dvc.lock'",
        "git add is how a stage may say it, too",
        "trained 2 iterations",
    ]
    assert relay.to_track == ["dvc.lock", "models/.gitignore"]
    assert not relay.skipped
    relay.feed("Stage 'train' didn't change, skipping", finished=True)
    assert relay.skipped


def test_a_warning_is_logged_without_the_source_line_under_it(tmp_path):
    script = tmp_path / "stage.py"
    script.write_text(
        "import warnings\n\nprint('before')\nwarnings.warn('careful\\nsecond line')\n"
        "print('after')\n"
    )
    log = Recorder()
    code = relay_command(
        [sys.executable, str(script)], str(tmp_path), _environment(), StageRelay("x", log, tmp_path)
    )
    assert code == 0
    assert [(level, text) for _, level, text in log.records] == [
        (logging.INFO, "before"),
        (logging.WARNING, "UserWarning: careful (stage.py:4)"),
        (logging.INFO, "second line"),
        (logging.INFO, "after"),
    ]


def test_a_failing_stage_fails_with_the_end_of_its_output(tmp_path, monkeypatch):
    import flows.pipeline

    monkeypatch.setattr(flows.pipeline, "get_run_logger", lambda: logging.getLogger("stage"))
    with pytest.raises(
        StageFailed,
        match=r"stage train failed with exit code \d+:\nERROR: .*not inside of a DVC repo",
    ):
        run_stage.fn("train", str(tmp_path))  # not a DVC repository


def test_a_command_over_its_timeout_is_stopped_with_every_process_it_started(tmp_path):
    import psutil

    from flows.orchestration.relay import CommandTimedOut

    log = Recorder()
    with pytest.raises(CommandTimedOut, match=r"ran longer than 5 s and was stopped"):
        relay_command(
            [sys.executable, "-c", HANGING],
            str(tmp_path),
            _environment(),
            StageRelay("x", log),
            timeout=5,  # time for the child to start on a busy machine
        )
    [(_, _, child_pid)] = log.records
    # gone, or dead and not yet reaped by whoever inherited it
    with contextlib.suppress(psutil.NoSuchProcess):
        assert psutil.Process(int(child_pid)).status() == psutil.STATUS_ZOMBIE


def test_a_stage_over_its_timeout_fails_naming_the_key_and_releases_dvc_s_lock(
    tmp_path, monkeypatch
):
    import flows.pipeline
    from flows.pipeline import StageTimedOut

    monkeypatch.setattr(flows.pipeline, "get_run_logger", lambda: logging.getLogger("stage"))
    dvc = str(Path(sys.executable).parent / "dvc")
    subprocess.run([dvc, "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    script = tmp_path / "stage.py"
    script.write_text(HANGING)
    (tmp_path / "dvc.yaml").write_text(f"stages:\n  train:\n    cmd: {sys.executable} stage.py\n")
    with pytest.raises(
        StageTimedOut,
        match=r"stage train ran longer than flow.train_timeout \(3 s\) and was stopped with "
        r"every process it started; it is not retried.*resumes from its last checkpoint",
    ):
        run_stage.fn("train", str(tmp_path), timeout=3)
    # DVC let go of its lock: the next run of the stage goes ahead at once.
    script.write_text("print('done')\n")
    assert run_stage.fn("train", str(tmp_path), timeout=60)["status"] == "ran"


def test_a_timed_out_stage_is_not_retried_and_a_failed_one_is():
    from prefect.states import Failed

    from flows.pipeline import StageTimedOut, _retry_unless_timed_out

    assert not _retry_unless_timed_out(None, None, Failed(data=StageTimedOut("over")))
    assert _retry_unless_timed_out(None, None, Failed(data=StageFailed("exit code 1")))


PROMOTED = {
    "decision": "promoted",
    "reasons": ["pass: score 0.7 vs baseline 0.1: gain +0.6 (needs >= +0.02)"],
    "version": "v0003",
    "path": "models/production/v0003",
}
REJECTED = {
    "decision": "rejected",
    "reasons": [
        "FAIL: score 0.1 vs baseline 0.7: gain -0.6 (needs >= +0.02)",
        "pass: KL to reference 2.6 nats (budget 4.0)",
        "FAIL: EOS rate 0.5 (needs >= 0.85)",
    ],
}


def test_the_decision_names_the_new_version_or_why_not_and_what_stays():
    assert decision_message(PROMOTED, "models/production/v0003") == (
        "promoted as v0003: models/production/v0003"
    )
    assert decision_message(REJECTED, "models/production/v0002") == (
        "rejected (score 0.1 vs baseline 0.7: gain -0.6 (needs >= +0.02); EOS rate 0.5 "
        "(needs >= 0.85)); production stays v0002: models/production/v0002"
    )
    assert decision_message(REJECTED, None).endswith("; no production model yet")
    assert decision_message(PROMOTED, "models/production/v0003", decided=False) == (
        "nothing changed since the last decision (promoted); production stays v0003: "
        "models/production/v0003"
    )


def test_the_run_summary_names_the_production_model():
    paths = {
        "report": "/p/reports/eval/report.md",
        "metrics": "/p/reports/eval/metrics.json",
        "candidate": "/p/models/candidate",
        "registry": "/p/models/registry.json",
    }
    promoted = summary(
        paths
        | {
            "decision": "promoted",
            "decided": True,
            "version": "v0003",
            "production": "/p/models/production/v0003",
            "reasons": PROMOTED["reasons"],
            "message": "promoted as v0003: models/production/v0003",
        }
    )
    assert "production: /p/models/production/v0003 (promoted as v0003 by this run)" in promoted
    assert promoted.endswith("decision:   promoted as v0003: models/production/v0003")
    rejected = summary(
        paths
        | {
            "decision": "rejected",
            "decided": True,
            "version": None,
            "production": "/p/models/production/v0002",
            "reasons": REJECTED["reasons"],
            "message": decision_message(REJECTED, "models/production/v0002"),
        }
    )
    assert "production: /p/models/production/v0002 (stays: the candidate was rejected)" in rejected
    assert "\n  FAIL: EOS rate 0.5 (needs >= 0.85)\n" in rejected
    unchanged = summary(
        paths
        | {
            "decision": "promoted",
            "decided": False,
            "version": None,
            "production": "/p/models/production/v0003",
            "reasons": PROMOTED["reasons"],
            "message": decision_message(PROMOTED, "models/production/v0003", decided=False),
        }
    )
    assert "production: /p/models/production/v0003 (stays: nothing changed" in unchanged


def test_the_temporary_server_s_telemetry_is_off_unless_the_user_sets_it():
    from prefect.settings import (
        PREFECT_SERVER_ANALYTICS_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        get_current_settings,
        temporary_settings,
    )

    from flows.orchestration.local_server import local_server_settings

    def server() -> tuple[bool, int]:
        with local_server_settings():
            settings = get_current_settings().server
            return settings.analytics_enabled, settings.ephemeral.startup_timeout_seconds

    set_here = get_current_settings().server.model_fields_set
    if "analytics_enabled" not in set_here:
        assert server() == (False, 120)
    # As from the environment or a Prefect profile.
    user = {
        PREFECT_SERVER_ANALYTICS_ENABLED: True,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 30,
    }
    with temporary_settings(updates=user):
        assert server() == (True, 30)


def test_the_artifact_header_shows_promotion_reasons_as_text(tmp_path, monkeypatch):
    """The reasons quote folder and model names from the config: markup in them must not
    become a link, an image or HTML in the Prefect UI."""
    import shutil

    import flows.orchestration.outcome
    from tests.flows.conftest import ROOT

    shutil.copy2(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "reports" / "eval").mkdir(parents=True)
    (tmp_path / "reports" / "eval" / "report.md").write_text("# Evaluation\n")
    (tmp_path / "reports" / "eval" / "metrics.json").write_text('{"candidate/score": 0.5}')
    hostile = "FAIL: baseline [click me](http://evil.example) <img src=x onerror=alert(1)>"
    (tmp_path / "reports" / "promotion.json").write_text(
        json.dumps({"decision": "rejected", "reasons": [hostile]})
    )
    published = {}
    monkeypatch.setattr(
        flows.orchestration.outcome, "create_markdown_artifact", lambda **kw: published.update(kw)
    )
    monkeypatch.setattr(flows.orchestration.outcome, "create_table_artifact", lambda **kw: None)
    outputs = flows.orchestration.outcome.publish_results(str(tmp_path), {"promote": "ran"})
    header = published["markdown"].split("# Evaluation")[0]
    assert "**Decision: rejected**" in header
    for markup in ("[click me](", "<img", "http://"):
        assert markup not in header, header
    assert outputs["reasons"] == [hostile]  # the outputs keep the text as it is
