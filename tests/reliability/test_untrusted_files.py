"""Files that should only be read never run code, and paths never lead a run outside its folders."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import sys

import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from ppo_core.checkpoints.sharded import (
    load_sharded_checkpoint,
    read_dcp_metadata,
    save_sharded_checkpoint,
)
from ppo_core.checkpoints.store import (
    CheckpointError,
    _write_checksums,
    list_checkpoints,
    load_checkpoint_state,
    load_latest_good,
    save_checkpoint,
)
from ppo_core.config import ConfigError, load_config
from ppo_core.models.folders import ModelFolderError
from ppo_core.models.policy import load_actor_critic, load_causal_lm
from ppo_core.registry.versions import RegistryError, current_production


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


def _sharded_checkpoint(folder):
    """A sharded (DCP) checkpoint with a scheduler, written in one process: its folder, and a
    fresh model and optimizer of the same shapes to resume into."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    path = save_sharded_checkpoint(
        folder, 1, model, optimizer, lambda f: f.mkdir(), scheduler, {"kl_coef": 0.1}
    )
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    return path, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1)


def _plant_in_a_shard(path, marker) -> str:
    """Every tensor of the checkpoint's metadata pointed at one shard file rewritten to hold a
    pickled payload (the metadata itself kept to DCP's own classes)."""
    shard = sorted((path / "shards").glob("*.distcp"))[0]
    planted = _torch_saved(Payload(marker))
    shard.write_bytes(planted)
    metadata = read_dcp_metadata(path / "shards" / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path, info.offset, info.length = shard.name, 0, len(planted)
    with (path / "shards" / ".metadata").open("wb") as handle:
        pickle.dump(metadata, handle)
    return f"shards/{shard.name}"


def _torch_saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("planted", [".metadata", "shard", "optimizer_groups.pt", "scheduler.pt"])
def test_no_file_of_a_sharded_checkpoint_runs_code_even_with_valid_checksums(tmp_path, planted):
    """Each file that resuming from a sharded checkpoint opens, replaced by a pickle whose
    loading would create a folder, checksums rewritten to match: resuming refuses it, naming
    the file, and nothing runs."""
    path, model, optimizer = _sharded_checkpoint(tmp_path / "checkpoints")
    marker = tmp_path / "code-ran"
    if planted == ".metadata":
        (path / "shards" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        named = "shards/.metadata"
    elif planted == "shard":
        named = _plant_in_a_shard(path, marker)
    else:
        (path / planted).write_bytes(_torch_saved({"state": Payload(marker)}))
        named = planted
    _write_checksums(path)  # whoever can write the file can fix the checksums too
    with pytest.raises(CheckpointError, match=re.escape(named) + ".*refused"):
        loaded = load_checkpoint_state(path)  # as the trainer resumes: state, then the shards
        load_sharded_checkpoint(loaded["sharded"], model, optimizer)
    assert not marker.exists()
    # the file is live: a full unpickling load does run its code
    if planted == ".metadata":
        pickle.loads((path / "shards" / ".metadata").read_bytes())
    else:
        torch.load(path / named, weights_only=False)
    assert marker.is_dir()


def test_a_shard_named_with_digits_of_another_script_is_refused(tmp_path):
    """DCP names its shards ``__<rank>_<n>.distcp`` in ASCII digits; metadata pointing at a
    shard renamed ``__٠_٠.distcp`` (Arabic-Indic digits, which ``\\d`` matches), checksums
    rewritten to match, is refused naming it, as any other file is."""
    path, model, optimizer = _sharded_checkpoint(tmp_path / "checkpoints")
    shards = path / "shards"
    metadata = read_dcp_metadata(shards / ".metadata")
    renamed = "__٠_٠.distcp"
    (shard,) = {info.relative_path for info in metadata.storage_data.values()}  # one rank
    (shards / shard).rename(shards / renamed)
    for info in metadata.storage_data.values():
        info.relative_path = renamed
    with (shards / ".metadata").open("wb") as handle:
        pickle.dump(metadata, handle)
    _write_checksums(path)
    with pytest.raises(CheckpointError, match=f"lies in '{renamed}', not in a shard file"):
        loaded = load_checkpoint_state(path)
        load_sharded_checkpoint(loaded["sharded"], model, optimizer)


def test_checksums_naming_files_outside_the_checkpoint_are_refused(tmp_path):
    path, _, _ = _sharded_checkpoint(tmp_path / "checkpoints")
    outside = tmp_path / "secret.txt"
    outside.write_text("not the checkpoint's")
    sums = json.loads((path / "checksums.json").read_text())
    for name in ("../../secret.txt", str(outside)):
        (path / "checksums.json").write_text(json.dumps({**sums, name: "0" * 64}))
        with pytest.raises(CheckpointError, match="names a file outside it"):
            load_checkpoint_state(path)


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
