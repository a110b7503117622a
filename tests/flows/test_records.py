"""Backups of production and the registry in a real DVC remote, and runs as DVC experiments."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from flows.orchestration.records import (
    DvcRunner,
    back_up_production,
    experiment_name,
    restore_command,
    save_experiment,
)
from flows.pipeline import _in_session
from ppo_core.config import Config
from ppo_core.files import file_sha256, tree_sha256
from tests.flows.conftest import BIN, ROOT, environment

GIT = ["git", "-c", "user.email=ci@example.invalid", "-c", "user.name=ci"]


def run(cwd: Path, *command: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        command, cwd=cwd, env=environment(), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git + DVC project with a local remote, this project's .gitignore and params.yaml, and a
    production folder and registry like those the promote stage writes."""
    project = tmp_path / "project"
    project.mkdir()
    run(project, "git", "init", "-q")
    run(project, str(BIN / "dvc"), "init", "-q")
    run(project, str(BIN / "dvc"), "remote", "add", "-d", "local", str(tmp_path / "remote"))
    shutil.copy2(ROOT / ".gitignore", project / ".gitignore")
    shutil.copy2(ROOT / "params.yaml", project / "params.yaml")
    version = project / "models" / "production" / "v0001"
    version.mkdir(parents=True)
    (version / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (version / "config.json").write_text('{"model_type": "gpt2"}\n')
    (project / "models" / "registry.json").write_text(
        json.dumps({"current": "v0001", "versions": []}) + "\n"
    )
    run(project, *GIT, "add", "-A")
    run(project, *GIT, "commit", "-qm", "start")
    return project


# The flow sends its commands to its DVC process; `ppo`'s own callers start `dvc` commands.
@pytest.fixture(params=["dvc command", "flow's DVC process"])
def runner(request, repo) -> DvcRunner | None:
    return None if request.param == "dvc command" else _in_session(str(repo))


def test_production_and_the_registry_come_back_byte_identical_from_the_remote(repo, runner):
    config = Config()
    production = repo / "models" / "production"
    registry = repo / "models" / "registry.json"
    before = (tree_sha256(production), file_sha256(registry))

    outcome = back_up_production(repo, config, runner)
    assert outcome.done, outcome.message
    assert "dvc pull models/production.dvc models/registry.json.dvc" in outcome.message
    # The pointers are files git keeps (the project's .gitignore lets them through).
    status = run(repo, "git", "status", "--porcelain", "--untracked-files=all").stdout
    assert "models/production.dvc" in status and "models/registry.json.dvc" in status
    assert "models/production/" not in status  # the folder itself stays out of git

    # Lose the production folder, the registry and the local DVC cache: only the remote holds
    # the bytes now.
    shutil.rmtree(production)
    registry.unlink()
    shutil.rmtree(repo / ".dvc" / "cache")
    run(repo, str(BIN / "dvc"), *restore_command(config, repo).split()[1:])
    assert (tree_sha256(production), file_sha256(registry)) == before


def test_a_backup_without_a_reachable_remote_says_so_and_keeps_the_files(repo, runner):
    run(repo, str(BIN / "dvc"), "remote", "modify", "local", "url", "/proc/no-such-remote")
    outcome = back_up_production(repo, Config(), runner)
    assert not outcome.done
    assert "not in the remote" in outcome.message
    assert "dvc push models/production.dvc models/registry.json.dvc" in outcome.message
    assert (repo / "models" / "production" / "v0001" / "config.json").is_file()


def test_a_run_is_saved_as_an_experiment_without_changing_the_workspace(repo, runner):
    (repo / "params.yaml").write_text(
        (repo / "params.yaml").read_text().replace("  epochs: 4\n", "  epochs: 2\n")
    )
    status = run(repo, "git", "status", "--porcelain").stdout
    name = experiment_name("meteoric malamute!")
    assert name == "retrain-meteoric-malamute"
    outcome = save_experiment(repo, name, run=runner)
    assert outcome.done, outcome.message
    assert run(repo, "git", "status", "--porcelain").stdout == status
    shown = json.loads(run(repo, str(BIN / "dvc"), "exp", "show", "--json").stdout)
    [experiment] = [
        rev
        for commit in shown
        for exp in commit.get("experiments") or []
        for rev in exp["revs"]
        if rev["name"] == name
    ]
    params = experiment["data"]["params"]["params.yaml"]["data"]
    assert params["ppo"]["epochs"] == 2
    # Saving the same name again (a retried flow run) replaces it.
    assert save_experiment(repo, name, run=runner).done


def test_outside_git_the_experiment_is_not_recorded_and_the_reason_is_given(tmp_path):
    run(tmp_path, str(BIN / "dvc"), "init", "-q", "--no-scm")
    outcome = save_experiment(tmp_path, "retrain-x")
    assert not outcome.done and outcome.message.startswith("not recorded as a DVC experiment")
