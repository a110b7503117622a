"""A tiny copy of the project for pipeline tests: the real dvc.yaml, code and raw data, with
params.yaml shrunk so that every stage takes seconds."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
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
    "promote.min_improvement": -10.0,
    "promote.max_kl": 100.0,
    "promote.min_eos_rate": 0.0,
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
    from flows.run_params import set_params

    set_params(str(folder), TINY_PARAMS)
    git = ["git", "-c", "user.email=ci@example.invalid", "-c", "user.name=ci"]
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    subprocess.run([*git, "add", "-A"], cwd=folder, check=True)
    subprocess.run([*git, "commit", "-qm", "tiny project"], cwd=folder, check=True)
    return folder


@pytest.fixture
def tiny_project(tmp_path) -> Path:
    return make_tiny_project(tmp_path / "project")


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


def readme_block(section: str) -> str:
    """The first ```bash block after the heading ``section`` of the README."""
    text = (ROOT / "README.md").read_text()
    return re.search(r"```bash\n(.*?)```", text[text.index(section) :], flags=re.DOTALL).group(1)


def run_readme_block(project: Path, section: str, replace: dict[str, str]) -> str:
    """Run a README block verbatim (``set -euo pipefail``) in ``project``, with each key of
    ``replace`` (a placeholder path) replaced; returns its output after checking it succeeded
    without a traceback."""
    block = readme_block(section)
    for placeholder, value in replace.items():
        assert placeholder in block, f"{placeholder} is not in the README block {section!r}"
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
