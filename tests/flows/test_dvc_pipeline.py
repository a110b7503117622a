"""`dvc repro` runs the real stages on tiny data; reruns only what changed."""

from __future__ import annotations

import pytest

from tests.flows.conftest import dvc, read_json


def ran(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")}


@pytest.mark.slow
def test_repro_then_nothing_then_only_what_a_param_touches(tiny_project):
    first = dvc(tiny_project, "repro")
    assert first.returncode == 0, first.stdout + first.stderr
    assert ran(first.stdout) == {"prepare", "base", "validate", "train", "evaluate", "promote"}
    assert (tiny_project / "models" / "candidate" / "model.safetensors").is_file()
    assert (tiny_project / "reports" / "validation" / "data_docs" / "index.html").is_file()
    metrics = read_json(tiny_project / "reports" / "eval" / "metrics.json")
    assert "candidate/score" in metrics and "baseline/score" in metrics
    assert read_json(tiny_project / "models" / "registry.json")["current"] == "v0001"

    second = dvc(tiny_project, "repro")
    assert second.returncode == 0
    assert ran(second.stdout) == set(), second.stdout
    assert "Data and pipelines are up to date" in second.stdout

    third = dvc(tiny_project, "exp", "run", "-S", "ppo.clip_eps=0.1")
    assert third.returncode == 0, third.stdout + third.stderr
    assert ran(third.stdout) == {"train", "evaluate", "promote"}, third.stdout

    shown = dvc(tiny_project, "metrics", "show", "--json")
    assert shown.returncode == 0 and "candidate/score" in shown.stdout
    push = dvc(tiny_project, "push")
    assert push.returncode == 0, push.stderr
    assert (tiny_project / ".dvc-storage").is_dir()
