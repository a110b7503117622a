"""`dvc repro` runs the real stages on tiny data and reruns only what changed; `dvc exp run`
records each experiment's params and metrics."""

from __future__ import annotations

import math
import subprocess

import pytest

from tests.flows.conftest import BIN, dvc, environment, experiment_scores, ran, read_json


@pytest.mark.slow
def test_repro_then_nothing_then_only_what_a_param_touches(tiny_project):
    # The project was built by `dvc repro validate` (prepare, base, validate), and committed.
    first = dvc(tiny_project, "repro")
    assert first.returncode == 0, first.stdout + first.stderr
    assert ran(first.stdout) == {"reward", "train", "evaluate", "promote"}, first.stdout
    for stage in ("prepare", "base", "validate"):
        assert f"Stage '{stage}' didn't change, skipping" in first.stdout, first.stdout
    assert (tiny_project / "models" / "candidate" / "model.safetensors").is_file()
    assert (tiny_project / "reports" / "validation" / "data_docs" / "index.html").is_file()
    metrics = read_json(tiny_project / "reports" / "eval" / "metrics.json")
    assert "candidate/score" in metrics and "baseline/score" in metrics
    assert read_json(tiny_project / "models" / "registry.json")["current"] == "v0001"

    second = dvc(tiny_project, "repro")
    assert second.returncode == 0
    assert ran(second.stdout) == set(), second.stdout
    assert "Data and pipelines are up to date" in second.stdout

    committed = (tiny_project / "params.yaml").read_text()
    third = dvc(tiny_project, "exp", "run", "-n", "clip-0.1", "-S", "ppo.clip_eps=0.1")
    assert third.returncode == 0, third.stdout + third.stderr
    assert ran(third.stdout) == {"train", "evaluate", "promote"}, third.stdout
    # The experiment's params.yaml stays in the workspace, and `-S` rewrote nothing but the
    # value (params.yaml is in the form DVC writes).
    assert "  clip_eps: 0.2\n" in committed
    assert (tiny_project / "params.yaml").read_text() == committed.replace(
        "  clip_eps: 0.2\n", "  clip_eps: 0.1\n"
    )

    # The experiment recorded its metrics (git-tracked), so the table has numbers, not `!`.
    shown = dvc(tiny_project, "exp", "show", "--json")
    assert shown.returncode == 0, shown.stderr
    scores = experiment_scores(shown.stdout)
    assert set(scores) == {"clip-0.1"}, scores
    assert all(s is not None and math.isfinite(s) for s in scores.values()), scores
    # `ppo compare`: a row per run (the commit, the workspace, the experiment), the one param
    # that changed beside the headline
    compared = subprocess.run(
        [str(BIN / "ppo"), "compare"],
        cwd=tiny_project,
        env={**environment(), "COLUMNS": "100"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert compared.returncode == 0, compared.stderr
    table = compared.stdout
    assert "ppo.clip_eps" in table and "score" in table and "tokens/s" in table, table
    rows = {line.split()[0]: line for line in table.splitlines() if "clip-0." in line}
    assert set(rows) == {"clip-0.1"}, table
    assert "workspace" in table, table
    assert all(len(line) <= 100 for line in table.splitlines()), table

    metrics = dvc(tiny_project, "metrics", "show", "--json")
    assert metrics.returncode == 0 and "candidate/score" in metrics.stdout
    assert not (tiny_project / ".dvc-storage").exists()  # so what is there below came from push
    push = dvc(tiny_project, "push")
    assert push.returncode == 0, push.stderr
    assert any(p.is_file() for p in (tiny_project / ".dvc-storage").rglob("*"))
    remote = dvc(tiny_project, "status", "--cloud")  # every tracked output is in the remote
    assert remote.returncode == 0 and "in sync" in remote.stdout, remote.stdout + remote.stderr


def test_dvc_yaml_names_the_configured_outputs():
    """Every path dvc.yaml tracks is the one params.yaml configures (or a file the stage writes
    inside it), and every code dependency exists."""
    import yaml

    from flows.loggers import metric_file
    from ppo_core.config import load_config
    from tests.flows.conftest import ROOT

    config = load_config(ROOT / "params.yaml")
    pipeline = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    stages = pipeline["stages"]

    def paths(stage: str, kind: str) -> set[str]:
        return {next(iter(e)) if isinstance(e, dict) else e for e in stages[stage].get(kind, [])}

    train_metrics, evals = config.train.metrics_dir, config.eval.output_dir
    assert paths("prepare", "outs") == {config.data.interim_dir}
    assert paths("base", "outs") == {config.model.policy}
    assert paths("validate", "outs") == {
        config.data.prepared_dir,
        f"{config.validation.report_dir}/summary.json",
    }
    assert paths("validate", "metrics") == set()  # settings, not measurements
    assert paths("train", "outs") == {config.train.output_dir, config.train.checkpoint_dir}
    assert paths("train", "metrics") == {f"{train_metrics}/metrics.json"}
    assert paths("train", "plots") == {
        str(metric_file(train_metrics, "any").parent),
        f"{train_metrics}/curves.png",
    }
    assert paths("evaluate", "outs") == {
        f"{evals}/{name}" for name in ("samples.json", "report.md", "models.json")
    }
    assert paths("evaluate", "metrics") == {f"{evals}/metrics.json"}
    assert paths("promote", "outs") == {config.promote.report}
    assert {f"{evals}/metrics.json", config.train.output_dir} <= paths("promote", "deps")
    assert {config.data.prepared_dir, config.model.policy} <= paths("train", "deps")
    plotted = {file for plot in pipeline["plots"] for spec in plot.values() for file in spec["y"]}
    assert plotted == {
        str(metric_file(train_metrics, key)) for key in ("rollout/score", "rollout/kl")
    }
    for stage in stages:
        for dep in paths(stage, "deps"):
            if dep.startswith(("ppo_core", "flows")):
                assert (ROOT / dep).exists(), f"dvc.yaml stage {stage} depends on missing {dep}"
