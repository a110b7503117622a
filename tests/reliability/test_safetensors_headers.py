"""A safetensors file whose header lies about its tensors (offsets past the end of the file, a
value head without its tensors) is one line naming the folder, never a traceback."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from typer.testing import CliRunner

from flows.cli import app
from ppo_core.models.folders import ModelFolderError
from ppo_core.models.policy import load_actor_critic, load_causal_lm


def lying_safetensors(path) -> None:
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [1000000], "data_offsets": [0, 4000000]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)


def test_weights_whose_header_lies_are_refused_in_one_line(tmp_path, tiny_model_dir, monkeypatch):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    lying_safetensors(folder / "model.safetensors")
    with pytest.raises(ModelFolderError, match="cannot load policy from"):
        load_causal_lm(folder)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["base", f"base.source={folder}", "model.policy=b"])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("damage", ["lying header", "other tensors"])
def test_a_damaged_value_head_is_refused_by_name(tmp_path, tiny_model_dir, damage):
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    head = folder / "value_head.safetensors"
    if damage == "lying header":
        lying_safetensors(head)
    else:
        save_file({"payload": torch.zeros(2)}, str(head))
    with pytest.raises(ModelFolderError, match="value_head.safetensors"):
        load_actor_critic(folder)
