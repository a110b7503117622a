"""Scheduled retraining chains generations: each imports the current production version as its
base (what `from_production` does), trains on it, and may promote the result. Two LoRA
generations through the CLI (where the chain broke; full weights chain in the soak below and in
test_flow.py): every version stays loadable and hash-checked
after the next base import, the next generation's baseline is exactly the production model, the
registry records each version's parent and the chain's origin, drift from the origin is
measured, and a rollback makes the next generation start from the version rolled back to
(docs/operations.md, "Running it for months")."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from ppo_core.registry.versions import check_version, load_registry
from tests.flows.conftest import BIN, environment, read_json


def ppo(project: Path, *args: str) -> str:
    done = subprocess.run(
        [str(BIN / "ppo"), *args],
        cwd=project,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"ppo {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def generation(project: Path, *overrides: str) -> dict:
    """One scheduled run by hand: import production (when there is one), train, evaluate,
    promote; returns the evaluation's metrics."""
    current = load_registry(project / "models" / "registry.json")["current"]
    if current is not None:
        ppo(project, "base", f"base.source=models/production/{current}")
    trained = ppo(project, "train", "--quiet", *overrides)
    assert "(resumed at 0)" in trained  # never the previous generation's checkpoint
    ppo(project, "evaluate", *overrides)
    ppo(project, "promote", *overrides)
    return read_json(project / "reports" / "eval" / "metrics.json")


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["lora"])  # full weights: the soak below, and test_flow.py
def test_two_generations_chain_and_every_version_stays_loadable(tiny_project, weights, monkeypatch):
    from ppo_core.models.policy import load_causal_lm

    project = tiny_project
    # an adapter at the full-weights learning rate barely moves the tiny model in two
    # generations (a sampled KL to the origin of -0.007 nats was measured), too little drift
    # for the bound below to judge; LoRA's usual tenfold rate moves it clearly
    overrides = ["model.lora.enabled=true", "optim.lr=1.5e-3"] if weights == "lora" else []
    first = generation(project, *overrides)
    # a chain's first generation: its origin is the reference itself
    assert first["candidate/kl_to_origin"] == first["candidate/kl_to_reference"]
    second = generation(project, *overrides)

    registry = load_registry(project / "models" / "registry.json")
    assert registry["current"] == "v0002"
    one, two = registry["entries"]
    assert (one["parent_version"], two["parent_version"]) == (None, "v0001")
    assert one["origin"] == two["origin"]
    origin = project / one["origin"]["path"]
    assert origin.parent == project / "models" / "production" / "bases"
    record = read_json(project / "models" / "base" / "imported_from.json")
    assert record["parent_version"] == "v0001" and record["origin"] == one["origin"]
    assert record["format"] == ("merged adapter" if weights == "lora" else "folder")

    # the next generation's base is exactly production: its baseline (v0001) samples what
    # v0001 sampled as the candidate, and has no KL to its own reference
    assert second["baseline/score"] == pytest.approx(first["candidate/score"], abs=1e-6)
    assert abs(second["baseline/kl_to_reference"]) < 1e-3
    assert math.isfinite(second["candidate/kl_to_origin"])
    assert second["candidate/kl_to_origin"] != second["candidate/kl_to_reference"]

    # every version loads and is hash-checked, the first one after models/base was replaced;
    # an adapter version names its base under production, stored once per distinct base
    monkeypatch.chdir(project)  # paths in the project's records are the project's
    bases = sorted(p.name for p in (project / "models" / "production" / "bases").iterdir())
    for version in ("v0001", "v0002"):
        folder = check_version(
            project / "models" / "registry.json", project / "models" / "production", version
        )
        load_causal_lm(folder)
        if weights == "lora":
            named = json.loads((folder / "adapter_base.json").read_text())["base"]
            assert named.startswith("models/production/bases/")
    assert len(bases) == (2 if weights == "lora" else 1), bases  # origin (+ merged v0001)

    # a rollback makes v0001 current again (the second generation's evaluation compared with
    # v0001 and its base came from v0001, so the gate may judge that evaluation again below;
    # while v0002 is current, promote refuses it as stale)
    ppo(project, "rollback", "v0001", "--reason", "v0002 regressed on support chats")
    registry = load_registry(project / "models" / "registry.json")
    assert registry["current"] == "v0001"
    assert registry["entries"][-1]["decision"] == "rolled back"
    assert registry["entries"][-1]["previous"] == "v0002"

    # the cumulative drift is bounded: the same evaluation, judged with a smaller
    # promote.max_kl_from_origin, is refused naming the key (and production stays v0001)
    drift = second["candidate/kl_to_origin"]
    print(f"KL to origin after two generations: {drift:.4f} nats")
    assert drift > 0.01, drift  # a k1 estimate; measured 0.145
    limit = drift / 2
    refused = ppo(project, "promote", *overrides, f"promote.max_kl_from_origin={limit}")
    assert "candidate rejected" in refused
    assert "FAIL: KL to the chain's origin" in refused and "promote.max_kl_from_origin" in refused
    assert load_registry(project / "models" / "registry.json")["current"] == "v0001"

    # the next generation starts from the version rolled back to
    ppo(project, "base", "base.source=models/production/v0001")
    assert read_json(project / "models" / "base" / "imported_from.json")["parent_version"] == (
        "v0001"
    )


def deployment_run(env, project, name: str) -> dict:
    """Start a run of deployment ``retrain/<name>`` and wait for it to end; returns it."""
    from tests.flows.servers import api, prefect, wait_for

    started = prefect(env, project, "deployment", "run", f"retrain/{name}")
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = next(line.split()[-1] for line in started.stdout.splitlines() if "UUID" in line)

    def ended() -> bool:
        return api(env, f"flow_runs/{run_id}")["state_type"] in {"COMPLETED", "FAILED", "CRASHED"}

    wait_for(ended, 900, f"the run of retrain/{name}")
    return api(env, f"flow_runs/{run_id}")


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.skipif(  # before the fixtures are built
    os.environ.get("PPO_SOAK") != "1",
    reason="make soak runs it (PPO_SOAK=1); make test runs the two-generation chain",
)
@pytest.mark.parametrize("weights", ["lora", "full"])
def test_three_scheduled_generations_through_the_work_pool_and_a_restore(
    tiny_project, tmp_path, weights, monkeypatch
):
    """`make soak` only (PPO_SOAK=1): three runs of 'retrain/scheduled' by a worker of the
    process pool, new prompts ingested before each of the later two; then a restore drill of
    every version from the DVC remote into an empty clone."""
    from flows.orchestration.run_params import set_params
    from ppo_core.models.policy import load_causal_lm
    from tests.flows.conftest import git_commit
    from tests.flows.servers import (
        command,
        prefect,
        start_server,
        start_worker,
        stop,
        write_prompts,
    )

    project = tiny_project
    if weights == "lora":
        set_params(str(project), {"model.lora.enabled": True})
        git_commit(project, "LoRA")
    env, logs, server = start_server(tmp_path, {"PREFECT_WORKER_QUERY_SECONDS": "2"})
    worker = None
    try:
        for args in (
            ("work-pool", "create", "ppo", "--type", "process"),
            ("--no-prompt", "deploy", "--all"),
        ):
            done = prefect(env, project, *args)
            assert done.returncode == 0, done.stdout + done.stderr
        worker = start_worker(env, tmp_path, logs / "worker.log")
        for generation in (1, 2, 3):
            if generation > 1:
                new = write_prompts(
                    tmp_path / f"new-{generation}.jsonl",
                    [f"Generation {generation} asks about film number {i}." for i in range(12)],
                )
                done = command(env, project, str(BIN / "ppo"), "ingest", "--no-event", str(new))
                assert done.returncode == 0, done.stdout + done.stderr
            run = deployment_run(env, project, "scheduled")
            assert run["state_type"] == "COMPLETED", (logs / "worker.log").read_text()[-3000:]
            assert f"promoted as v000{generation}" in run["state"]["message"]
            git_commit(project, f"generation {generation}")  # dvc.lock and the backup pointers

        registry = load_registry(project / "models" / "registry.json")
        entries = registry["entries"]
        assert [e["parent_version"] for e in entries] == [None, "v0001", "v0002"]
        assert len({json.dumps(e["origin"]) for e in entries}) == 1
        assert all(math.isfinite(e["metrics"]["kl_to_origin"]) for e in entries)
        assert len(list((project / "data" / "raw").iterdir())) == 3  # two files ingested

        # a rollback is recorded and backed up like a decision
        rolled = command(
            env, project, str(BIN / "ppo"), "rollback", "v0002", "--reason", "drill", "--by", "ops"
        )
        assert rolled.returncode == 0, rolled.stdout + rolled.stderr
        assert "backed up in the DVC remote" in rolled.stderr
        git_commit(project, "rollback to v0002")

        # restore drill: an empty clone of the project's git history, the remote only
        clone = tmp_path / "clone"
        subprocess.run(["git", "clone", "-q", str(project), str(clone)], check=True)
        dvc = [str(BIN / "dvc")]
        subprocess.run(
            [*dvc, "remote", "modify", "--local", "local", "url", str(project / ".dvc-storage")],
            cwd=clone,
            check=True,
        )
        pulled = subprocess.run(
            [*dvc, "pull", "models/production.dvc", "models/registry.json.dvc"],
            cwd=clone,
            env=environment(),
            capture_output=True,
            text=True,
            check=False,
        )
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
        monkeypatch.chdir(clone)
        restored = load_registry("models/registry.json")
        assert restored["current"] == "v0002" and restored["entries"][-1]["by"] == "ops"
        for version in ("v0001", "v0002", "v0003"):
            folder = check_version("models/registry.json", "models/production", version)
            load_causal_lm(folder)
    finally:
        if worker is not None:
            stop(worker)
        stop(server)


@pytest.mark.slow
def test_a_lora_version_promoted_before_bases_were_kept_survives_the_next_import(
    tiny_project, monkeypatch
):
    """An upgraded project: v0001 is an adapter whose record names models/base (as promotions
    before stored bases wrote it). The next generation's import keeps that base under
    models/production/bases/ first, and v0001 still loads after models/base is replaced."""
    from ppo_core.files import tree_sha256
    from ppo_core.models.adapter_folders import point_adapter_at
    from ppo_core.models.policy import load_causal_lm

    project = tiny_project
    generation(project, "model.lora.enabled=true")
    monkeypatch.chdir(project)
    version, registry_file = Path("models/production/v0001"), Path("models/registry.json")
    record = json.loads((version / "adapter_base.json").read_text())
    point_adapter_at(version, "models/base", record["base_sha256"])  # what it named before
    registry = json.loads(registry_file.read_text())
    for entry in registry["entries"]:
        for key in ("origin", "parent_version", "adapter_base"):
            entry.pop(key, None)
    registry["entries"][0]["content_sha256"] = tree_sha256(version)
    registry_file.write_text(json.dumps(registry))
    for stored in Path("models/production/bases").iterdir():
        subprocess.run(["rm", "-r", str(stored)], check=True)

    ppo(project, "base", "base.source=models/production/v0001")
    assert read_json(Path("models/base/imported_from.json"))["format"] == "merged adapter"
    assert (Path("models/production/bases") / record["base_sha256"]).is_dir()
    load_causal_lm(check_version(registry_file, "models/production", "v0001"))
