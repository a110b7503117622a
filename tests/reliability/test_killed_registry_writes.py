"""A production promotion, rollback or export killed (SIGKILL) at each of its steps leaves a
state the next run recovers without a hand edit. A promotion (``ppo_core.registry.staging``): a
version whose folder is in place with the recorded hash is finished, any other is abandoned, no
staging copy is left, and no later promotion is blocked. An export (``flows/export.py``): the
file is put in place only after the registry names it, so the next export either finds it
complete or writes it again over the leftovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ppo_core.files import tree_sha256
from ppo_core.registry.gate import GateDecision
from ppo_core.registry.versions import (
    check_version,
    current_production,
    load_registry,
    record_decision,
    roll_back,
)
from tests.flows.conftest import ROOT

PASS = GateDecision(True, ["PASS"])

KILLER = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path

    import ppo_core.files.copying as copying
    import ppo_core.registry.staging as staging
    import ppo_core.registry.versions as versions
    from ppo_core.registry.gate import GateDecision

    root, candidate, point = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    copy_file, write, rename = copying._copy_file, versions._write_registry, os.rename

    def copy_one_then_die(*args, **kwargs):  # mid-copy: one file of the staging copy written
        copy_file(*args, **kwargs)
        die()

    def write_then_maybe_die(path, registry):
        decisions = [e.get("decision") for e in registry["entries"]]
        if point == "before the final write" and decisions[-1] == "promoted":
            die()
        if point == "in the rollback's write" and decisions[-1] == "rolled back":
            die()
        write(path, registry)
        if point == "after the promoting entry" and decisions[-1] == "promoting":
            die()

    def rename_then_die(source, target):
        rename(source, target)
        if Path(target).name.startswith("v"):
            die()

    if point == "during the staging copy":
        copying._copy_file = copy_one_then_die
    elif point == "after the staging copy":
        staging.fsync_tree = lambda folder: die()
    elif point == "after the rename":
        staging.os.rename = rename_then_die
    versions._write_registry = write_then_maybe_die
    registry, production = root / "registry.json", root / "production"
    if point == "in the rollback's write":
        versions.roll_back(
            registry_path=registry, production_dir=production, version="v0001",
            reason="drill", by="ops",
        )
    else:
        versions.record_decision(
            registry_path=registry, production_dir=production, candidate_dir=candidate,
            decision=GateDecision(True, ["KILLED"]), lineage={"data_hash": "k"},
        )
    sys.exit("not killed")
    """
)
KILL_POINTS = {
    # point: what the next registry write makes of the killed promotion of v0003
    "during the staging copy": "unrecorded",
    "after the staging copy": "unrecorded",
    "after the promoting entry": "abandoned",
    "after the rename": "completed",
    "before the final write": "completed",
}


def model_folder(tmp_path: Path, name: str, weights: str) -> Path:
    folder = tmp_path / name
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_text(weights)
    (folder / "sub" / "extra.json").write_text(json.dumps({"of": name}))
    return folder


def promote(root: Path, tmp_path: Path, name: str) -> dict:
    return record_decision(
        registry_path=root / "registry.json",
        production_dir=root / "production",
        candidate_dir=model_folder(tmp_path, name, f"weights of {name}"),
        decision=PASS,
        lineage={"data_hash": name},
    )


def killed(tmp_path: Path, point: str) -> Path:
    """Production with v0001 and v0002 promoted (v0002 current), then one more promotion (or a
    rollback) killed at ``point``."""
    root = tmp_path / "models"
    promote(root, tmp_path, "w1")
    promote(root, tmp_path, "w2")
    done = subprocess.run(
        [sys.executable, "-c", KILLER, str(root), str(model_folder(tmp_path, "k", "w-k")), point],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    return root


def promote_next(root: Path, tmp_path: Path) -> None:
    promote(root, tmp_path, "w-next")


def rollback(root: Path, _tmp_path: Path) -> None:
    roll_back(
        registry_path=root / "registry.json",
        production_dir=root / "production",
        version="v0001",
        reason="after the kill",
        by="ops",
    )


@pytest.mark.parametrize("point", KILL_POINTS)
@pytest.mark.parametrize("after", [promote_next, rollback])
def test_a_promotion_killed_at_each_step_is_finished_or_abandoned_by_the_next_write(
    tmp_path, point, after
):
    root = killed(tmp_path, point)
    registry, production = root / "registry.json", root / "production"
    # readers are not held up by the half promotion: v0002 stays current until a write
    assert current_production(registry, production) == production / "v0002"
    outcome = KILL_POINTS[point]
    assert (production / ".v0003.staging").is_dir() == (outcome != "completed")

    after(root, tmp_path)

    book = load_registry(registry)
    assert not [e for e in book["entries"] if e["decision"] == "promoting"]
    assert not [p.name for p in production.iterdir() if p.name.endswith(".staging")]
    [entry] = [e for e in book["entries"] if e.get("reasons", [""])[0] == "KILLED"] or [None]
    if outcome == "unrecorded":
        assert entry is None
    elif outcome == "completed":
        assert entry["decision"] == "promoted" and entry["version"] == "v0003"
        assert tree_sha256(production / "v0003") == entry["content_sha256"]
        assert check_version(registry, production, "v0003") == production / "v0003"
    else:
        assert entry["decision"] == "abandoned"
        assert entry["reasons"][-1] == "interrupted before it was in place"
    # and the promotion after that succeeds, numbered past every version in place
    last = promote(root, tmp_path, "w-last")
    assert check_version(registry, production, last["version"]) == production / last["version"]
    in_place = sorted(p.name for p in production.iterdir() if p.name.startswith("v"))
    assert in_place[-1] == last["version"]
    assert load_registry(registry)["current"] == last["version"]


def test_a_rollback_killed_in_its_write_changes_nothing_and_can_be_run_again(tmp_path):
    root = killed(tmp_path, "in the rollback's write")
    registry, production = root / "registry.json", root / "production"
    assert load_registry(registry)["current"] == "v0002"
    assert [e["decision"] for e in load_registry(registry)["entries"]] == ["promoted"] * 2
    rollback(root, tmp_path)
    assert current_production(registry, production) == production / "v0001"


EXPORT_KILLER = textwrap.dedent(
    """
    import os, signal, sys

    import flows.export as export
    import ppo_core.models.gguf_export as gguf_export
    from ppo_core.config import load_config

    point, overrides = sys.argv[1], sys.argv[2:]

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "while the file is written":
        gguf_export.os.link = die
    elif point == "after the file is written":
        export.file_sha256 = die
    elif point == "after the record beside it":
        export.record_export = die
    elif point == "after the registry names it":
        export.os.rename = die
    elif point == "after the rename":
        export.fsync_folder = die
    export.export_version(load_config(overrides=overrides))
    sys.exit("not killed")
    """
)
EXPORT_KILL_POINTS = [
    "while the file is written",
    "after the file is written",
    "after the record beside it",
    "after the registry names it",
    "after the rename",
]


@pytest.mark.parametrize("point", EXPORT_KILL_POINTS)
def test_an_export_killed_at_each_step_is_completed_by_the_next_export(
    tmp_path, tiny_model_dir, point
):
    from flows.stages import export
    from ppo_core.config import load_config
    from ppo_core.files import file_sha256

    root = tmp_path / "models"
    record_decision(
        registry_path=root / "registry.json",
        production_dir=root / "production",
        candidate_dir=tiny_model_dir,
        decision=PASS,
        lineage={"data_hash": "d"},
    )
    overrides = [
        f"promote.registry={root / 'registry.json'}",
        f"promote.production_dir={root / 'production'}",
        f"export.dir={tmp_path / 'exports'}",
        "export.type=f32",
    ]
    done = subprocess.run(
        [sys.executable, "-c", EXPORT_KILLER, point, *overrides],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    gguf = tmp_path / "exports" / "v0001-f32.gguf"
    assert gguf.exists() == (point == "after the rename")

    record = export(load_config(overrides=overrides))
    assert record.get("already_exported", False) == (point == "after the rename")
    exports = load_registry(root / "registry.json")["entries"][-1]["exports"]
    assert exports == [{"file": str(gguf), "type": "f32", "sha256": file_sha256(gguf)}]
    assert json.loads(gguf.with_suffix(".json").read_text())["sha256"] == file_sha256(gguf)
    # nothing of the killed export is left beside it (the lock file stays, empty)
    assert sorted(p.name for p in gguf.parent.iterdir()) == [
        ".v0001-f32.gguf.lock",
        "v0001-f32.gguf",
        "v0001-f32.json",
    ]
