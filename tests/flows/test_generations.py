"""Scheduled retraining chains generations: each imports the current production version as its
base (what `from_production` does), trains on it, and may promote the result. Two generations
through the CLI, with LoRA and with full weights: every version stays loadable and hash-checked
after the next base import, the next generation's baseline is exactly the production model, the
registry records each version's parent and the chain's origin, drift from the origin is
measured, and a rollback makes the next generation start from the version rolled back to
(docs/operations.md, "Running it for months")."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from ppo_core.registry import check_version, load_registry
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
@pytest.mark.parametrize("weights", ["lora", "full"])
def test_two_generations_chain_and_every_version_stays_loadable(
    tiny_project, weights, monkeypatch
):
    from ppo_core.modeling.policy import load_causal_lm

    project = tiny_project
    overrides = ["model.lora.enabled=true"] if weights == "lora" else []
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

    # a rollback makes v0001 current again, and the next generation starts from it
    ppo(project, "rollback", "v0001", "--reason", "v0002 regressed on support chats")
    registry = load_registry(project / "models" / "registry.json")
    assert registry["current"] == "v0001"
    assert registry["entries"][-1]["decision"] == "rolled back"
    assert registry["entries"][-1]["previous"] == "v0002"
    ppo(project, "base", "base.source=models/production/v0001")
    assert read_json(project / "models" / "base" / "imported_from.json")["parent_version"] == (
        "v0001"
    )
