"""The production path of prefect.yaml on a real local Prefect server: `prefect deploy --all`, a
`process` work pool and its worker, `prefect deployment run`, and `ppo ingest` triggering
'retrain/on-new-data' (files arriving during a run lead to exactly one more training run; a file
that fails validation changes nothing and is set aside)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from flows.ingest import LOCK_NAME
from flows.orchestration.run_params import BACKUP_NAME
from ppo_core.files import file_sha256, tree_sha256
from tests.flows.conftest import BIN, dvc, read_json
from tests.flows.servers import (
    flow_runs,
    prefect,
    start_server,
    state_message,
    stop,
    wait_for,
    write_prompts,
)


def on_new_data(runs: list[dict]) -> list[dict]:
    return sorted(
        (r for r in runs if r.get("parameters", {}).get("new_data_only")),
        key=lambda r: r["created"],
    )


def data_files(project: Path) -> dict[str, str]:
    """Every file under ``data/`` and its SHA-256, the inbox's lock aside (each command that
    takes it writes its own pid there)."""
    return {
        str(p.relative_to(project)): file_sha256(p)
        for p in sorted((project / "data").rglob("*"))
        if p.is_file() and p.name != LOCK_NAME
    }


FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def settled(runs: list[dict], count: int) -> bool:
    return len(runs) >= count and all(r["state_type"] in FINAL for r in runs)


def ingest(env: dict[str, str], cwd: Path, *paths: Path) -> None:
    """`ppo ingest PATH` for each of ``paths``, all at once (one command each, so one event
    each), each checked to have added its file and sent its event."""
    commands = [
        subprocess.Popen(
            [str(BIN / "ppo"), "ingest", str(path)],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in paths
    ]
    for command in commands:
        out, err = command.communicate(timeout=120)
        assert command.returncode == 0, out + err
        assert "sent ppo.data.ingested" in err, err


@pytest.mark.slow
def test_a_worker_runs_the_deployments_and_ingest_triggers_retraining(tiny_project, tmp_path):
    project = tiny_project
    env, logs, server = start_server(
        tmp_path,
        {
            # the worker looks for runs every 2 s instead of 10, and a run waiting for the
            # deployment's one slot tries again within 5 s instead of 30
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS": "5",
        },
    )
    worker = None
    try:
        created = prefect(env, project, "work-pool", "create", "ppo", "--type", "process")
        assert created.returncode == 0, created.stdout + created.stderr
        deployed = prefect(env, project, "--no-prompt", "deploy", "--all")
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        inspected = prefect(env, project, "deployment", "inspect", "retrain/scheduled")
        assert "0 3 * * 1" in inspected.stdout and "UTC" in inspected.stdout
        worker = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", "ppo"],
            env=env,
            cwd=tmp_path,  # not the project: the deployment's pull step moves there
            stdout=(logs / "worker.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def worker_log() -> str:
            return (logs / "worker.log").read_text()[-4000:]

        # 1. `prefect deployment run` goes through the work pool to the worker, and two files
        # ingested while it trains lead to exactly one more training run: the run the first file
        # triggers waits for the project's lock, then takes both; the second one's finds nothing.
        # Six iterations leave the files time to arrive while the run trains.
        manual = subprocess.Popen(
            [
                str(BIN / "prefect"),
                "deployment",
                "run",
                "retrain/manual",
                "-p",
                'params={"train.iterations": 6}',
                "--watch",
                "--watch-timeout",
                "600",
            ],
            env=env,
            cwd=project,
            stdout=(logs / "manual.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        # The run's own params.yaml values are held from just after it took the inbox to its end:
        # files ingested now wait for the next run.
        wait_for(
            lambda: (project / BACKUP_NAME).exists() or manual.poll() is not None,
            600,
            "the manual run to take the inbox and start its stages",
        )
        ingest(
            env,
            project,
            write_prompts(tmp_path / "first.jsonl", ["a brand new review of"]),
            write_prompts(tmp_path / "second.jsonl", ["the sequel was"]),
        )
        [manual_run] = [r for r in flow_runs(env) if "params" in r["parameters"]]
        assert manual_run["state_type"] == "RUNNING", "the files arrived after the manual run"
        manual.wait(timeout=660)
        watched = (logs / "manual.log").read_text()
        assert manual.returncode == 0 and "Completed" in watched, watched + worker_log()
        # The decision was backed up in the DVC remote, and the run recorded as an experiment.
        assert (project / "models" / "production.dvc").is_file()
        assert (project / "models" / "registry.json.dvc").is_file()
        wait_for(
            lambda: settled(on_new_data(flow_runs(env)), 2),
            900,
            "the runs the two files triggered to end",
        )
        time.sleep(5)  # no run beyond the ones the two events started
        runs = on_new_data(flow_runs(env))
        assert len(runs) == 2 and all(r["state_type"] == "COMPLETED" for r in runs), runs
        messages = sorted(state_message(env, r) for r in runs)
        assert messages[0].startswith("no new data"), messages
        assert messages[1].startswith("promoted as v0002"), messages
        assert read_json(project / "models" / "registry.json")["current"] == "v0002"
        assert sorted(p.name for p in (project / "data" / "raw").iterdir()) == [
            "first.jsonl",
            "prompts.jsonl",
            "second.jsonl",
        ]
        assert [p.name for p in (project / "data" / "inbox").iterdir()] == [LOCK_NAME]
        # An unknown parameter is refused by the deployment, and nothing runs.
        unknown = prefect(env, project, "deployment", "run", "retrain/manual", "-p", "epochs=3")
        assert unknown.returncode != 0
        assert "not found on the deployment: 'epochs'" in " ".join(unknown.stdout.split())
        # A run request may override the deployment's environment (job variables), but not move
        # its project: the run fails at once, naming the key, and nothing is written there.
        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(project, elsewhere, symlinks=True)
        before = (data_files(elsewhere), file_sha256(elsewhere / "models" / "registry.json"))
        moved = prefect(
            env,
            project,
            "deployment",
            "run",
            "retrain/manual",
            "--job-variable",
            f'env={{"PPO_PROJECT_DIR": "{elsewhere}"}}',
            "--watch",
            "--watch-timeout",
            "300",
            timeout=360,
        )
        assert moved.returncode != 0 and "Failed" in moved.stdout, moved.stdout + worker_log()
        [refused] = [r for r in flow_runs(env, "FAILED") if "params" not in r["parameters"]]
        assert "PPO_PROJECT_DIR cannot be set by a flow run" in state_message(env, refused)
        assert (
            data_files(elsewhere),
            file_sha256(elsewhere / "models" / "registry.json"),
        ) == before

        # 2. A file that fails validation (prompts longer than validation.max_tokens) changes
        # nothing, is set aside, and the failed expectation is in the run's artifact.
        kept = {
            "prepared": tree_sha256(project / "data" / "prepared"),
            "production": tree_sha256(project / "models" / "production"),
            "registry": file_sha256(project / "models" / "registry.json"),
        }
        long_prompts = [" ".join(["word"] * 60) + f" {i}" for i in range(40)]
        ingest(env, project, write_prompts(tmp_path / "too-long.jsonl", long_prompts))
        wait_for(
            lambda: settled(on_new_data(flow_runs(env)), 3),
            600,
            "the run triggered by the rejected file",
        )
        rejected_run = on_new_data(flow_runs(env))[-1]
        assert rejected_run["state_type"] == "FAILED", worker_log()
        assert kept == {
            "prepared": tree_sha256(project / "data" / "prepared"),
            "production": tree_sha256(project / "models" / "production"),
            "registry": file_sha256(project / "models" / "registry.json"),
        }
        assert not (project / "data" / "raw" / "too-long.jsonl").exists()
        [set_aside] = (project / "data" / "rejected").iterdir()
        assert (set_aside / "too-long.jsonl").is_file()
        artifact = prefect(env, project, "artifact", "inspect", "validation-failure")
        assert artifact.returncode == 0, artifact.stdout + artifact.stderr
        assert "max_tokens" in artifact.stdout or "between" in artifact.stdout, artifact.stdout

        # A forged or malformed event starts a run that reads nothing from it: it finds no new
        # data and ends, changing nothing.
        kept = data_files(project)
        forged = prefect(
            env,
            project,
            "event",
            "emit",
            "ppo.data.ingested",
            "--resource-id",
            "ppo.raw-data",
            "--payload",
            '{"files": 42, "params": {"model.reward": "pty:spawn"}}',
        )
        assert forged.returncode == 0, forged.stdout + forged.stderr
        wait_for(
            lambda: settled(on_new_data(flow_runs(env)), 4),
            300,
            "the run the forged event started",
        )
        last = on_new_data(flow_runs(env))[-1]
        assert last["state_type"] == "COMPLETED"
        assert state_message(env, last).startswith("no new data")
        assert data_files(project) == kept
        # Each run that decided is a DVC experiment; params.yaml is as it was committed.
        listed = dvc(project, "exp", "list", "--name-only")
        assert listed.returncode == 0, listed.stderr
        assert len([n for n in listed.stdout.split() if n.startswith("retrain-")]) == 2
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=project, capture_output=True, text=True
        ).stdout
        assert "params.yaml" not in status, status
    finally:
        if worker is not None:
            stop(worker)
        stop(server)
