"""The `ppo` command: help, config listing, and one clear line for errors users can fix."""

import re

import yaml
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


COMMANDS = ["config", "prepare", "validate", "base", "train", "evaluate", "promote"]


def test_help_lists_the_stages():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    # the Commands panel, not the description above it (which names every stage too)
    panel = result.output.split("Commands")[1]
    assert re.findall(r"^\W+([a-z]+)  ", panel, flags=re.MULTILINE) == COMMANDS
    for command in COMMANDS:  # and each is a command of its own
        usage = runner.invoke(app, [command, "--help"])
        assert usage.exit_code == 0 and f"Usage: ppo {command} [OPTIONS]" in usage.output


def test_config_prints_resolved_yaml():
    result = runner.invoke(app, ["config", "ppo.epochs=2", "kl.estimator=k3"])
    assert result.exit_code == 0
    printed = yaml.safe_load(result.output)
    assert printed["ppo"]["epochs"] == 2 and printed["kl"]["estimator"] == "k3"  # not the defaults
    assert printed["ppo"]["mini_batch_size"] == 16  # and the rest resolved from the defaults


def test_a_config_typo_is_one_clear_error(tmp_path):
    result = runner.invoke(app, ["train", "ppo.epoch=2", f"train.output_dir={tmp_path / 'out'}"])
    assert result.exit_code == 2
    assert "unknown config key 'ppo.epoch' (override 'ppo.epoch=2')" in result.output
    assert "Did you mean 'ppo.epochs'?" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_a_missing_model_folder_is_one_clear_error(tmp_path):
    result = runner.invoke(app, ["train", f"model.policy={tmp_path / 'missing'}"])
    assert result.exit_code == 2
    message = " ".join(result.output.split())  # the console wraps long lines
    assert message.startswith(
        f"error: model.policy folder '{tmp_path / 'missing'}' does not exist;"
    )
    assert "Traceback" not in result.output
