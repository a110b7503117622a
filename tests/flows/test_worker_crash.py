"""A worker killed mid-training with every process under it, as when its machine dies: the
automation of automations.yaml marks the run Crashed when its heartbeats stop, the deployment's
trigger (prefect.yaml) starts it again, and the worker, started again, runs it from the last
checkpoint instead of from the start."""

from __future__ import annotations

import time

import psutil
import pytest
import yaml

from flows.orchestration.run_params import set_params
from tests.flows.conftest import ROOT
from tests.flows.servers import (
    WebhookReceiver,
    flow_runs,
    notify,
    prefect,
    start_server,
    start_worker,
    stop,
    wait_for,
)

# Heartbeats every 30 s (the least Prefect allows), and a run without one for 45 s is Crashed.
HEARTBEAT_S = 30
UNRESPONSIVE_S = 45


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything under it, frozen first so that nothing escapes."""
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    for process in tree:
        process.suspend()
    for process in tree:
        process.kill()


def manual_runs(env, project) -> list[dict]:
    """The runs of 'retrain/manual' (not the scheduled deployment's future runs)."""
    return [r for r in flow_runs(env) if not r["parameters"].get("from_production")]


@pytest.mark.slow
def test_a_run_whose_worker_died_is_started_again_and_resumes(tiny_project, tmp_path):
    project = tiny_project
    # Long enough to be killed between its first checkpoint and its end.
    set_params(str(project), {"train.iterations": 12, "train.checkpoint_every": 1})
    env, logs, server = start_server(
        tmp_path,
        {
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS": "5",
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
            # a slot a dead run held is free again after 30 s at the latest
            "PREFECT_SERVER_CONCURRENCY_INITIAL_DEPLOYMENT_LEASE_DURATION": "30",
        },
    )
    worker = None
    receiver = WebhookReceiver()
    try:
        notify(env, project, receiver.url)
        automations = yaml.safe_load((ROOT / "automations.yaml").read_text())
        for automation in automations["automations"]:
            automation["trigger"]["within"] = UNRESPONSIVE_S
        (tmp_path / "automations.yaml").write_text(yaml.safe_dump(automations))
        for args in (
            ("work-pool", "create", "ppo", "--type", "process"),
            ("--no-prompt", "deploy", "--all"),
            ("automation", "create", "--from-file", str(tmp_path / "automations.yaml")),
        ):
            done = prefect(env, project, *args)
            assert done.returncode == 0, done.stdout + done.stderr
        log = logs / "worker.log"
        worker = start_worker(env, tmp_path, log)
        started = prefect(env, project, "deployment", "run", "retrain/manual")
        assert started.returncode == 0, started.stdout + started.stderr

        checkpoints = project / "checkpoints"
        deadline = time.monotonic() + 600
        while not list(checkpoints.glob("step-*")):  # older ones are pruned: any will do
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(0.05)
        kill_tree(worker.pid)
        assert not (project / "models" / "candidate").exists()
        [dead] = manual_runs(env, project)
        assert dead["state_type"] == "RUNNING"  # nothing told the server

        worker = start_worker(env, tmp_path, log)

        def resumed_run_ended() -> bool:
            runs = manual_runs(env, project)
            return len(runs) == 2 and all(
                r["state_type"] in {"COMPLETED", "FAILED", "CRASHED"} for r in runs
            )

        wait_for(resumed_run_ended, 600, "the crashed run to be marked and run again")
        runs = {r["id"]: r for r in manual_runs(env, project)}
        assert runs.pop(dead["id"])["state_type"] == "CRASHED"
        [restart] = runs.values()
        assert restart["state_type"] == "COMPLETED", log.read_text()[-3000:]
        # a restart, bounded: one crash is under the limit of prefect.yaml
        assert restart["parameters"]["restart_limit"] == 3
        assert restart["parameters"]["backup"] is True  # the deployment's own parameters kept
        text = log.read_text()
        # The new run's training picked up where the checkpoints end, not at iteration 0.
        assert "(resumed at 0)" not in text
        assert "resumed at " in text, text[-3000:]
        # someone heard about the crash (flows/orchestration/notifications.py)
        wait_for(lambda: receiver.with_subject("Crashed"), 60, "the crash notification")
        [message] = receiver.with_subject("Crashed")
        assert f"run {dead['name']} Crashed" in message["subject"]
        assert "No heartbeat from this run" in message["body"]
    finally:
        receiver.close()
        if worker is not None:
            stop(worker)
        stop(server)
