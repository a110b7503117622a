"""`prefect deployment run 'retrain/manual'` reaches the served deployment on a local server."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows.orchestration.run_params import set_params
from tests.flows.conftest import BIN, read_json
from tests.flows.servers import api, flow_runs, start_server, state_message, stop, wait_for


def deployment_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`prefect deployment run 'retrain/manual' ARGS`, its output as one text."""
    return subprocess.run(
        [str(BIN / "prefect"), "deployment", "run", "retrain/manual", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
        timeout=300,
    )


@pytest.mark.slow
def test_deployment_run_reaches_the_served_flow(tiny_project, tmp_path):
    # Fire every minute, so that the test sees the schedule start a run on its own.
    set_params(str(tiny_project), {"schedule.cron": "* * * * *"})
    # The scheduler looks for due runs every 5 s (60 s by default) and the served runner asks for
    # them every 2 s (10 s), so the scheduled run starts soon after its minute comes.
    env, logs, server = start_server(
        tmp_path,
        {
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
            "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        },
    )
    served = None
    try:
        served = subprocess.Popen(
            [sys.executable, "-m", "flows.pipeline", "serve", "--repo", str(tiny_project)],
            env=env,
            cwd=Path(__file__).resolve().parents[2],
            stdout=(logs / "serve.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def deployed() -> bool:
            return api(env, "deployments/name/retrain/manual") is not None

        wait_for(deployed, 120, "the served deployments")
        scheduled = subprocess.run(
            [str(BIN / "prefect"), "deployment", "inspect", "retrain/scheduled"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert scheduled.returncode == 0 and "* * * * *" in scheduled.stdout

        def scheduled_run_in(*state_types: str) -> bool:
            return any(r["parameters"].get("from_production") for r in flow_runs(env, *state_types))

        wait_for(
            lambda: scheduled_run_in("RUNNING", "COMPLETED"), 300, "the schedule to start a run"
        )
        # One scheduled run is enough: later ones would each retrain from production (the
        # project's params.yaml starts from the configured base) and hold the one slot.
        paused = subprocess.run(
            [str(BIN / "prefect"), "--no-prompt", "deployment", "schedule", "pause", "--all"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert paused.returncode == 0, paused.stdout + paused.stderr
        wait_for(lambda: scheduled_run_in("COMPLETED"), 600, "the scheduled run to complete")
        assert read_json(tiny_project / "models" / "registry.json")["current"] == "v0001"
        run = subprocess.run(
            [
                str(BIN / "prefect"),
                "deployment",
                "run",
                "retrain/manual",
                "--watch",
                "--watch-timeout",
                "600",
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=660,
        )
        assert run.returncode == 0, (
            run.stdout + run.stderr + (logs / "serve.log").read_text()[-3000:]
        )
        assert "Completed" in run.stdout
        # The decision ends what --watch shows (a server streams events out, not logs): promoted,
        # or nothing to decide when the schedule has just run on the same inputs.
        watched = " ".join(run.stdout.split())  # the console wraps long lines
        decision = re.search(
            r"ppo\.candidate\.(promoted|unchanged) \* (promoted as v\d{4}|nothing changed)", watched
        )
        assert decision is not None, run.stdout
        assert decision.start() > watched.rfind("prefect.task-run.Completed * promote") > 0

        # A run cannot point the flow at another folder, nor set what is not a training setting.
        registry = (tiny_project / "models" / "registry.json").read_bytes()
        params_file = (tiny_project / "params.yaml").read_bytes()
        elsewhere = deployment_run(env, "-p", f"repo_dir={tmp_path}")
        assert elsewhere.returncode != 0
        assert "not found on the deployment: 'repo_dir'" in " ".join(elsewhere.stdout.split())
        reward = deployment_run(env, "-p", 'params={"model.reward": "pty:spawn"}', "--watch")
        assert reward.returncode != 0 and "Failed" in reward.stdout, reward.stdout
        # It failed for that reason, in the run's own final message.
        [refused] = [
            r
            for r in flow_runs(env, "FAILED")
            if (r.get("parameters") or {}).get("params", {}).get("model.reward")
        ]
        message = state_message(env, refused)
        assert "params: 'model.reward' cannot be set by a flow run" in message, message
        assert (tiny_project / "models" / "registry.json").read_bytes() == registry
        assert (tiny_project / "params.yaml").read_bytes() == params_file
    finally:
        if served is not None:
            stop(served)
        stop(server)
