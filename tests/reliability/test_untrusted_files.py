"""Files that should only be read never run code, and paths never lead a run outside its folders."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import sys

import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from ppo_core.config import ConfigError, load_config
from ppo_core.modeling.checkpoint import (
    CheckpointError,
    _write_checksums,
    list_checkpoints,
    load_checkpoint_state,
    load_latest_good,
    save_checkpoint,
)
from ppo_core.modeling.policy import ModelFolderError, load_actor_critic, load_causal_lm
from ppo_core.registry import RegistryError, current_production


class Payload:
    """Unpickling this object creates a folder: proof that a file's code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickled_model_weights_are_never_loaded(tmp_path, tiny_model_dir):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": Payload(marker)}))
    with pytest.raises(ModelFolderError, match="no safetensors weights.*pytorch_model.bin"):
        load_causal_lm(folder)
    assert not marker.exists()
    # the file is live: unpickling it does run its code
    pickle.loads((folder / "pytorch_model.bin").read_bytes())
    assert marker.is_dir()


def test_a_folder_that_needs_its_own_code_is_refused_without_trust_remote_code(
    tmp_path, tiny_model_dir, monkeypatch
):
    from transformers import dynamic_module_utils

    folder = tmp_path / "model_with_code"
    shutil.copytree(tiny_model_dir, folder)
    marker = tmp_path / "code-ran"
    (folder / "evil.py").write_text(
        f"import os\nos.mkdir({str(marker)!r})\n"
        "from transformers import GPT2LMHeadModel\n"
        "class EvilModel(GPT2LMHeadModel):\n    pass\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    with contextlib.suppress(ModelFolderError):  # refusing is fine; running the file is not
        load_actor_critic(folder)  # default: trust_remote_code=False
    assert not marker.exists(), "a model folder's Python file ran without trust_remote_code"
    # The folder is live: with trust_remote_code the file runs (its module copy goes to tmp_path).
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m.startswith("transformers_modules")]:
        monkeypatch.delitem(sys.modules, name)
    load_actor_critic(folder, trust_remote_code=True)
    assert marker.is_dir(), "the test folder's code would not have run anyway"


def test_a_pickled_object_in_a_checkpoint_is_refused_even_with_valid_checksums(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2):
        save_checkpoint(
            tmp_path, step, lambda f: f.mkdir(), optimizer.state_dict(), None, {"x": step}
        )
    newest = list_checkpoints(tmp_path)[-1]
    marker = tmp_path / "code-ran"
    torch.save({"state": Payload(marker)}, newest / "optimizer.pt")
    _write_checksums(newest)  # an attacker who can write the file can fix the checksums too
    with pytest.raises(CheckpointError, match="optimizer.pt: refused to load"):
        load_checkpoint_state(newest)
    assert not marker.exists()
    folder, state, problems = load_latest_good(tmp_path)
    assert folder.name == "step-000001" and state["state"]["x"] == 1
    assert "refused to load" in problems[0]
    assert not marker.exists()
    # the file is live: a full unpickling load does run its code
    torch.load(newest / "optimizer.pt", weights_only=False)
    assert marker.is_dir()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train.output_dir", "../outside", "leaves the working folder"),
        ("train.checkpoint_dir", "checkpoints/../../outside", "leaves the working folder"),
        ("promote.registry", "../../registry.json", "leaves the working folder"),
        ("train.output_dir", "models/base", "would write over model.policy"),
        ("train.output_dir", "models/production/v0001", "overlap"),
        ("train.metrics_dir", "checkpoints/metrics", "overlap"),
        ("data.interim_dir", "data/prepared", "overlap"),
    ],
)
def test_write_paths_stay_in_their_folders(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[f"{key}={value}"])


def test_an_edited_registry_cannot_point_outside_the_production_folder(tmp_path):
    registry = tmp_path / "registry.json"
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "config.json").write_text("{}")
    for current in ("../secret", "/etc", "v1/../../secret"):
        registry.write_text(json.dumps({"current": current, "entries": []}))
        with pytest.raises(RegistryError, match="names version"):
            current_production(registry, tmp_path / "production")


def test_the_cli_reports_a_tampered_registry_in_one_line(tmp_path, tiny_model_dir, prompt_files):
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"current": "../x", "entries": []}))
    shutil.copytree(tiny_model_dir, tmp_path / "candidate")
    result = CliRunner().invoke(
        app,
        [
            "evaluate",
            f"promote.registry={registry}",
            f"model.policy={tiny_model_dir}",
            f"train.output_dir={tmp_path / 'candidate'}",
            f"data.eval_file={prompt_files[1]}",
            f"eval.output_dir={tmp_path / 'eval'}",
            f"promote.production_dir={tmp_path / 'prod'}",
        ],
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "names version '../x'" in result.output
    assert not (tmp_path / "eval").exists()
