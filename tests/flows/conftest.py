"""A tiny copy of the project for pipeline tests: the real dvc.yaml, code and raw data, with
params.yaml shrunk so that every stage takes seconds."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

TINY_PARAMS = {
    "threads": 1,
    "base.tiny_steps": 30,
    "validation.min_train_rows": 16,
    "validation.min_eval_rows": 4,
    "ppo.rollout_batch_size": 16,
    "ppo.mini_batch_size": 8,
    "ppo.micro_batch_size": 8,
    "ppo.epochs": 1,
    "generation.max_new_tokens": 6,
    "train.iterations": 2,
    "train.checkpoint_every": 1,
    "eval.num_prompts": 8,
    "eval.samples_per_prompt": 1,
    # The gate lets every candidate through: the scenarios are about orchestration, and a model
    # trained for a few iterations on 8 held-out prompts may fail any rule by chance (the guards
    # against a gamed reward included; tests/evaluation/test_evaluation.py tests those).
    "promote.min_improvement": -10.0,
    "promote.max_kl": 100.0,
    "promote.max_kl_from_origin": None,
    "promote.min_eos_rate": 0.0,
    "promote.max_distinct_2_drop": None,
    "promote.max_nll_increase": None,
}


def project_files() -> list[str]:
    """Files git would check out (tracked plus untracked-but-not-ignored)."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [
        f
        for f in listing
        if (ROOT / f).is_file() and not f.startswith(("tests/", "bench/", "docs/"))
    ]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    return env


def make_tiny_project(folder: Path, n_prompts: int = 120) -> Path:
    for name in project_files():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    (folder / "dvc.lock").unlink(missing_ok=True)
    raw = (ROOT / "data" / "raw" / "prompts.jsonl").read_text().splitlines()[:n_prompts]
    (folder / "data" / "raw" / "prompts.jsonl").write_text("\n".join(raw) + "\n")
    sys.path.insert(0, str(ROOT))
    from flows.orchestration.run_params import set_params

    set_params(str(folder), TINY_PARAMS)
    git = ["git", "-c", "user.email=ci@example.invalid", "-c", "user.name=ci"]
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    subprocess.run([*git, "add", "-A"], cwd=folder, check=True)
    subprocess.run([*git, "commit", "-qm", "tiny project"], cwd=folder, check=True)
    return folder


def ran(output: str) -> set[str]:
    """The stages a `dvc repro` output says it ran."""
    return {
        line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")
    }


def git_commit(project: Path, message: str) -> None:
    git = ["git", "-c", "user.email=ci@example.invalid", "-c", "user.name=ci"]
    subprocess.run([*git, "add", "-A"], cwd=project, check=True)
    subprocess.run([*git, "commit", "-qm", message], cwd=project, check=True)


def copy_project(source: Path, target: Path) -> Path:
    """A copy of a project with its git history, DVC cache and workspace outputs (file times
    kept); DVC's own temporary state (.dvc/tmp: locks, its index of file hashes by inode) stays
    behind and is built anew in the copy."""
    shutil.copytree(
        source,
        target,
        symlinks=True,
        ignore=lambda folder, _: ["tmp"] if Path(folder).name == ".dvc" else [],
    )
    return target


@pytest.fixture(scope="session")
def built_project(tmp_path_factory, worker_id) -> Path:
    """A tiny project whose first three stages (prepare, base, validate) have run through
    `dvc repro` and been committed with their dvc.lock; built once per test session and shared
    by the pytest workers (copy it with :func:`copy_project`, never change it).

    Scenarios that are about training, evaluation, promotion or orchestration start from it
    instead of building the tiny model and validating the data again (about 45 s each here);
    the three stages themselves are proven by this build, which fails every test using it when
    one of them fails."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if worker_id != "master" else base  # one folder for all the workers
    folder = shared / "built-project"
    with (shared / "built-project.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker builds, the others wait for it
        if not (folder / ".git").is_dir() or (folder / ".building").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            (folder / ".building").touch()
            make_tiny_project(folder)
            done = dvc(folder, "repro", "validate")
            assert done.returncode == 0, done.stdout + done.stderr
            assert ran(done.stdout) == {"prepare", "base", "validate"}, done.stdout
            (folder / ".building").unlink()
            git_commit(folder, "prepare, base and validate through dvc repro")
    return folder


@pytest.fixture
def tiny_project(built_project, tmp_path) -> Path:
    """A fresh copy of :func:`built_project`: prepared, validated data and the tiny base model,
    committed, ready to train."""
    return copy_project(built_project, tmp_path / "project")


def dvc(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "dvc"), *args],
        cwd=project,
        env=environment(),
        capture_output=True,
        text=True,
        check=False,
    )


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def doc_block(doc: str, section: str) -> str:
    """The first ```bash block after the heading ``section`` of the file ``doc`` (relative to
    the repository root, e.g. ``docs/customizing.md``)."""
    text = (ROOT / doc).read_text()
    return re.search(r"```bash\n(.*?)```", text[text.index(section) :], flags=re.DOTALL).group(1)


def run_doc_block(project: Path, doc: str, section: str, replace: dict[str, str]) -> str:
    """Run a documented block verbatim (``set -euo pipefail``) in ``project``, with each key of
    ``replace`` (a placeholder path) replaced; returns its output after checking it succeeded
    without a traceback."""
    block = doc_block(doc, section)
    for placeholder, value in replace.items():
        assert placeholder in block, f"{placeholder} is not in the block {section!r} of {doc}"
        block = block.replace(placeholder, value)
    done = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + block],
        cwd=project,
        env=environment(),
        capture_output=True,
        text=True,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Traceback" not in output
    return output


def experiment_scores(shown: str) -> dict[str, float | None]:
    """``{experiment name: candidate/score}`` from `dvc exp show --json` (None where the
    experiment has no reports/eval/metrics.json: the `!` of the table)."""
    scores = {}
    for baseline in json.loads(shown):
        for experiment in baseline.get("experiments") or []:
            for rev in experiment["revs"]:
                metrics = (rev["data"].get("metrics") or {}).get("reports/eval/metrics.json", {})
                scores[rev["name"]] = metrics.get("data", {}).get("candidate/score")
    return scores


class Recorder:
    """Log records as (seconds since creation, level, text)."""

    def __init__(self):
        self.start = time.monotonic()
        self.records: list[tuple[float, int, str]] = []

    def __call__(self, level: int, text: str) -> None:
        self.records.append((time.monotonic() - self.start, level, text))

    def at(self, level: int) -> list[str]:
        return [text for _, lvl, text in self.records if lvl == level]


# A stage that hangs, with a child of its own as `dvc repro` has: it prints the child's pid.
HANGING = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)
