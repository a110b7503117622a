"""What `dvc exp run` records and how runs are compared: the metrics files are kept by git (so
experiments hold them), params.yaml is in the form `dvc exp run -S` writes, and `ppo compare`
reads the headline metrics and the params that changed from `dvc exp show --json`.

The experiments themselves run in the slow test of test_dvc_pipeline.py (one tiny pipeline
serves both); these checks read files only."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from flows.experiments import HEADLINE, parse_exp_show
from tests.flows.conftest import ROOT


def stage_metrics() -> dict[str, dict]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    found = {}
    for stage in stages.values():
        for entry in stage.get("metrics", []):
            path, spec = next(iter(entry.items())) if isinstance(entry, dict) else (entry, {})
            found[path] = spec or {}
    return found


def flatten(data: dict, prefix: str = "") -> list[str]:
    """Column names as DVC forms them: nested keys joined by dots."""
    names = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        names.extend(flatten(value, f"{name}.") if isinstance(value, dict) else [name])
    return names


def ignored_by_git(paths: list[str]) -> set[str]:
    """The paths that .gitignore's patterns ignore (tracked or not)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return set(result.stdout.split())


def test_the_metrics_files_are_kept_by_git_and_the_other_reports_are_not():
    """A `cache: false` metric is recorded only through git: ignored, `dvc exp show` has `!`
    for every experiment. The rest of reports/ is rebuilt by the pipeline and stays out."""
    metrics = stage_metrics()
    assert set(metrics) == {
        "reports/train/metrics.json",
        "reports/eval/metrics.json",
        "reports/reward/metrics.json",
    }
    assert all(spec.get("cache") is False for spec in metrics.values())
    rebuilt = [
        "reports/eval/samples.json",
        "reports/eval/report.md",
        "reports/eval/models.json",
        "reports/train/curves.png",
        "reports/train/plots/metrics/rollout/score.tsv",
        "reports/validation/summary.json",
        "reports/validation/data_docs/index.html",
        "reports/promotion.json",
        "reports/reward/decision.json",
        "reports/reward/current.json",
    ]
    assert ignored_by_git([*metrics, *rebuilt]) == set(rebuilt)


def test_params_yaml_is_in_the_form_dvc_exp_run_writes(tmp_path):
    """`dvc exp run -S` rewrites params.yaml with ruamel.yaml (an empty value for null, lists in
    block style); a file already in that form comes back byte for byte, with the same values."""
    from dvc.utils.hydra import apply_overrides
    from omegaconf import OmegaConf

    text = (ROOT / "params.yaml").read_text()
    copy = tmp_path / "params.yaml"
    copy.write_text(text)
    seed = yaml.safe_load(text)["seed"]
    apply_overrides(str(copy), [f"seed={seed}"])  # what `dvc exp run -S seed=...` does to it
    assert copy.read_text() == text
    loaded = OmegaConf.load(copy)
    assert loaded.model.reference is None and loaded.eval.baseline is None  # empty is null


def test_the_headline_names_metrics_the_pipeline_writes():
    """A renamed metric would leave a `ppo compare` column empty for every run. Timings
    (``perf.``) are in ``reports/train/timings.json``, a top-level metrics file of dvc.yaml that
    git does not keep (tests/flows/test_loggers.py shows the logger writes them there)."""
    written = set()
    for path in stage_metrics():
        if not (ROOT / path).is_file():
            pytest.skip(f"{path} is written by `make run` (and committed)")
        written.update(flatten(json.loads((ROOT / path).read_text())))
    timings = [key for key, _ in HEADLINE if key.startswith("perf.")]
    assert {key for key, _ in HEADLINE} - set(timings) <= written
    assert timings and "reports/train/timings.json" in yaml.safe_load(
        (ROOT / "dvc.yaml").read_text()
    ).get("metrics", [])


def test_the_accuracy_columns_appear_where_a_run_has_them():
    """The task columns show only where a run has them (evaluate writes ``candidate/accuracy``
    and ``delta/accuracy`` for rows with answers: tests/flows/test_doc_answers.py)."""
    from flows.experiments import TASK_HEADLINE, Run, headline

    plain = Run("a", {}, {"candidate/score": 0.5})
    checked = Run("b", {}, {"candidate/score": 0.5, "candidate/accuracy": 0.9})
    assert headline([plain]) == list(HEADLINE)
    assert headline([plain, checked]) == [*HEADLINE, TASK_HEADLINE[0]]


def test_compare_reads_runs_params_and_metrics_from_exp_show():
    def entry(rev, name, clip, score):
        return {
            "rev": rev,
            "name": name,
            "data": {
                "params": {"params.yaml": {"data": {"seed": 0, "ppo": {"clip_eps": clip}}}},
                "metrics": {
                    "reports/eval/metrics.json": {"data": {"candidate/score": score}},
                    "reports/train/metrics.json": {"data": {"perf": {"tokens_per_s": 100}}},
                },
            },
        }

    payload = [
        entry("workspace", None, 0.2, 0.5),
        {
            **entry("0123456789abcdef", "main", 0.2, 0.5),
            "experiments": [{"revs": [entry("fedcba9876543210", "clip-0.1", 0.1, 0.7)]}],
        },
    ]
    runs = parse_exp_show(payload)
    assert [run.name for run in runs] == ["workspace", "main", "clip-0.1"]
    assert runs[2].params["ppo.clip_eps"] == 0.1
    assert runs[2].metrics == {"candidate/score": 0.7, "perf.tokens_per_s": 100.0}
    unnamed = parse_exp_show([entry("0123456789abcdef", None, 0.2, 0.5)])
    assert unnamed[0].name == "0123456"


def test_a_stuck_dvc_exp_show_is_stopped_with_one_message(tmp_path, monkeypatch):
    import flows.experiments

    # DVC takes far longer than this to start: the real command runs past its limit.
    monkeypatch.setattr(flows.experiments, "EXP_SHOW_TIMEOUT_S", 0.01)
    with pytest.raises(RuntimeError, match=r"dvc exp show did not finish within 0.01 s"):
        flows.experiments.compare_runs(tmp_path)
