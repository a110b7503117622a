"""A flow run's parameters: an allow-list, checked before anything is written, held in
params.yaml only while the run lasts; the project folder is not a parameter at all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import psutil
import pytest

from flows.orchestration.run_params import (
    BACKUP_NAME,
    RUN_PARAMS,
    RunParamsError,
    check_run_params,
    params_for_this_run,
    put_back_left_params,
)
from ppo_core.config import ConfigError, load_config
from tests.flows.conftest import ROOT


@pytest.fixture
def project(tmp_path):
    shutil.copy2(ROOT / "params.yaml", tmp_path / "params.yaml")
    return tmp_path


def listing(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# What the review ran through `retrain(params=...)`: a reward spec that runs a prompt as a
# program, remote code, output paths, the promotion gate, a timeout, a key that is not there.
@pytest.mark.parametrize(
    "key, value",
    [
        ("model.reward", "pty:spawn"),
        ("model.trust_remote_code", True),
        ("model.policy", "/etc"),
        ("train.output_dir", ".git"),
        ("data.interim_dir", "data/raw"),
        ("base.source", "/home"),
        ("promote.min_improvement", -1.0),
        ("promote.max_kl", 1e9),
        ("flow.train_timeout", 0),
        ("repo_dir", "/tmp/elsewhere"),
        ("ppo", {"epochs": 2}),
    ],
)
def test_a_key_outside_the_allow_list_is_refused_and_nothing_is_written(project, key, value):
    before = listing(project)
    with pytest.raises(RunParamsError, match=rf"params: '{key}' cannot be set by a flow run"):
        check_run_params(project, {key: value})
    assert listing(project) == before


@pytest.mark.parametrize(
    "params, message",
    [
        ({"ppo.epochs": "2"}, "ppo.epochs takes a number or true/false, not the string '2'"),
        ({"ppo.epochs": [2]}, "ppo.epochs must be a number, true/false or null; got a list"),
        ({"kl.adaptive": 1}, "kl.adaptive must be a bool; got 1"),
        ({"ppo.loss_agg_mode": "${oc.env:HOME}"}, "ppo.loss_agg_mode must be one of token-mean"),
        ({"ppo.micro_batch_size": 32}, "ppo.micro_batch_size=32 is larger than ppo.mini_batch"),
        ({"ppo.rollout_batch_size": 10**12}, "ppo.rollout_batch_size must be at most"),
        ({"ppo.epochs": 2.5}, "ppo.epochs"),
        ({"seed": 10**40}, f"seed must be at most {2**63 - 1}, got {10**40}"),
    ],
)
def test_a_bad_value_is_refused_naming_the_key_and_nothing_is_written(project, params, message):
    before = listing(project)
    with pytest.raises((RunParamsError, ConfigError), match=message.replace("$", r"\$")):
        check_run_params(project, params)
    assert listing(project) == before


def test_allowed_values_come_back_as_the_config_holds_them(project):
    checked = check_run_params(
        project,
        {
            "ppo.epochs": 2,
            "optim.lr": 1e-5,
            "kl.adaptive": True,
            "ppo.target_kl": None,
            "ppo.loss_agg_mode": "seq-mean-token-sum",
        },
    )
    assert checked == {
        "ppo.epochs": 2,
        "optim.lr": 1e-5,
        "kl.adaptive": True,
        "ppo.target_kl": None,
        "ppo.loss_agg_mode": "seq-mean-token-sum",
    }


def test_every_allowed_key_is_a_setting_of_how_training_runs():
    defaults = load_config()
    from omegaconf import OmegaConf

    tree = OmegaConf.structured(defaults)
    for key in RUN_PARAMS:
        value = OmegaConf.select(tree, key, default="missing")
        assert value != "missing", key
        assert not key.endswith(("_dir", "_file", "timeout")), key
        assert key.split(".")[0] in {"seed", "ppo", "kl", "optim", "generation", "train"}, key


def test_params_yaml_holds_the_run_s_values_only_while_it_lasts(project):
    original = (project / "params.yaml").read_bytes()
    with params_for_this_run(project, {"ppo.epochs": 2, "optim.lr": 1e-5}):
        assert load_config(project / "params.yaml").ppo.epochs == 2
        assert (project / BACKUP_NAME).is_file()
    assert (project / "params.yaml").read_bytes() == original
    assert not (project / BACKUP_NAME).exists()

    with (
        pytest.raises(RuntimeError, match="stage failed"),
        params_for_this_run(project, {"ppo.epochs": 3}),
    ):
        raise RuntimeError("stage failed")
    assert (project / "params.yaml").read_bytes() == original
    assert not (project / BACKUP_NAME).exists()


def test_an_edit_made_during_the_run_is_left_alone(project, capsys):
    with params_for_this_run(project, {"ppo.epochs": 2}):
        edited = (project / "params.yaml").read_text().replace("seed: 0", "seed: 7")
        (project / "params.yaml").write_text(edited)
    assert (project / "params.yaml").read_text() == edited
    assert "params.yaml was edited while the run held its own values" in capsys.readouterr().out


def test_the_next_run_puts_back_what_a_killed_run_left(project):
    original = (project / "params.yaml").read_bytes()
    assert put_back_left_params(project) is None
    killed = (
        "import os, sys\n"
        "from flows.orchestration.run_params import params_for_this_run\n"
        "with params_for_this_run(sys.argv[1], {'ppo.epochs': 2}):\n"
        "    os._exit(9)  # killed in the middle of the run: nothing after this line runs\n"
    )
    done = subprocess.run([sys.executable, "-c", killed, str(project)], cwd=ROOT, check=False)
    assert done.returncode == 9
    assert load_config(project / "params.yaml").ppo.epochs == 2
    message = put_back_left_params(project)
    assert message == (
        "an earlier run ended before it could restore params.yaml: params.yaml is back as it was"
    )
    assert (project / "params.yaml").read_bytes() == original
    assert not (project / BACKUP_NAME).exists()


def test_a_backup_written_before_params_yaml_was_replaced_is_dropped(project):
    original = (project / "params.yaml").read_bytes()
    (project / BACKUP_NAME).write_text(json.dumps({"original": "seed: 9\n", "written": None}))
    assert put_back_left_params(project) is None
    assert (project / "params.yaml").read_bytes() == original
    assert not (project / BACKUP_NAME).exists()


def test_the_flow_refuses_bad_params_before_it_takes_the_lock(project, monkeypatch):
    from flows.orchestration.project import PROJECT_ENV
    from flows.pipeline import retrain

    monkeypatch.setenv(PROJECT_ENV, str(project))
    before = listing(project)
    with pytest.raises(RunParamsError, match="'model.reward' cannot be set"):
        retrain.fn(params={"model.reward": "pty:spawn"})
    assert listing(project) == before  # no lock file, params.yaml untouched


def test_the_project_folder_is_not_a_parameter_of_the_flow():
    from prefect.exceptions import SignatureMismatchError

    from flows.pipeline import retrain

    with pytest.raises(SignatureMismatchError, match="repo_dir"):
        retrain.validate_parameters({"repo_dir": "/tmp/elsewhere"})
    assert retrain.validate_parameters({"params": {"ppo.epochs": 2}}) == {
        "from_production": False,
        "params": {"ppo.epochs": 2},
        "new_data_only": False,
        "backup": False,
        "restart_limit": 0,
    }


def test_the_project_folder_comes_from_where_the_flow_is_served(tmp_path, monkeypatch):
    from flows.orchestration.project import PROJECT_ENV, project_dir

    monkeypatch.setenv(PROJECT_ENV, str(tmp_path))
    assert project_dir() == tmp_path.resolve()
    monkeypatch.delenv(PROJECT_ENV)
    monkeypatch.chdir(tmp_path)
    assert project_dir() == tmp_path.resolve()


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("model.reward=pty:spawn", "error: params: 'model.reward' cannot be set by a flow run"),
        ("ppo.epochs=two", "error: params: ppo.epochs takes a number or true/false"),
        ("ppo.micro_batch_size=64", "error: ppo.micro_batch_size=64 is larger than"),
        ("epochs", "error: --set takes KEY=VALUE"),
    ],
)
def test_run_with_a_bad_setting_stops_in_one_line_before_a_server_starts(
    project, assignment, message, monkeypatch
):
    from flows.orchestration.project import PROJECT_ENV
    from flows.pipeline import main

    monkeypatch.setenv(PROJECT_ENV, str(project))  # main() sets it: restored after the test
    before = listing(project)
    with pytest.raises(SystemExit) as stopped:
        main(["run", "--repo", str(project), "-S", assignment])
    assert str(stopped.value.code).startswith(message)
    assert listing(project) == before
    # The run's own Prefect server, started early so that it comes up during the check, is
    # stopped with the run instead of running on until this process exits.
    servers = [
        child.cmdline()
        for child in psutil.Process().children(recursive=True)
        if "server" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE
    ]
    assert not servers, servers
