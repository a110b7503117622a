"""The `ppo` command: help, config listing, and one clear line for errors users can fix."""

from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


def test_help_lists_the_stages():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for stage in ("prepare", "validate", "base", "train", "evaluate", "config"):
        assert stage in result.output


def test_config_prints_resolved_yaml():
    result = runner.invoke(app, ["config", "ppo.epochs=2"])
    assert result.exit_code == 0
    assert "epochs: 2" in result.output


def test_a_config_typo_is_one_clear_error(tmp_path):
    result = runner.invoke(app, ["train", "ppo.epoch=2", f"train.output_dir={tmp_path / 'out'}"])
    assert result.exit_code == 2
    assert "unknown config key 'ppo.epoch'" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_a_missing_model_folder_is_one_clear_error(tmp_path):
    result = runner.invoke(app, ["train", f"model.policy={tmp_path / 'missing'}"])
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output
