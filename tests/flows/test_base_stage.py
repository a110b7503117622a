"""The base stage imports a user's model folder, and refuses one that is not a model."""

from __future__ import annotations

import json

import pytest

from flows.stages import base
from ppo_core.config import load_config
from ppo_core.models.folders import ModelFolderError
from ppo_core.models.policy import load_actor_critic


def test_import_a_local_model_folder(tmp_path, tiny_model_dir):
    config = load_config(
        overrides=[f"base.source={tiny_model_dir}", f"model.policy={tmp_path / 'base'}"]
    )
    path = base(config)
    record = json.loads((path / "imported_from.json").read_text())
    # outside the project: the folder's name and a content hash, no absolute path (user names)
    assert record["source"] == tiny_model_dir.name and record["inside_project"] is False
    assert str(tiny_model_dir.parent) not in json.dumps(record)
    assert (path / "model.safetensors").read_bytes() == (
        tiny_model_dir / "model.safetensors"
    ).read_bytes()
    load_actor_critic(path)  # loads as a policy


def test_a_folder_that_is_not_a_model_writes_nothing(tmp_path):
    not_a_model = tmp_path / "notes"
    not_a_model.mkdir()
    (not_a_model / "readme.txt").write_text("hello")
    config = load_config(
        overrides=[f"base.source={not_a_model}", f"model.policy={tmp_path / 'base'}"]
    )
    with pytest.raises(ModelFolderError, match="no config.json"):
        base(config)
    assert not (tmp_path / "base").exists()
