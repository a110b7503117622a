import pytest
import torch

from ppo_core.modeling.checkpoint import (
    CheckpointError,
    atomic_folder,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint_state,
    save_checkpoint,
)


def test_atomic_folder_keeps_the_old_version_on_failure(tmp_path):
    target = tmp_path / "out"
    atomic_folder(target, lambda tmp: (tmp / "a.txt").write_text("v1"))

    def failing(tmp):
        (tmp / "a.txt").write_text("v2-partial")
        raise RuntimeError("crash while writing")

    with pytest.raises(RuntimeError, match="crash"):
        atomic_folder(target, failing)
    assert (target / "a.txt").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left behind
    atomic_folder(target, lambda tmp: (tmp / "b.txt").write_text("v2"))
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]


def _save(folder, iteration, keep=2):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()

    def save_model(path):
        path.mkdir()
        torch.save(model.state_dict(), path / "weights.pt")

    return save_checkpoint(folder, iteration, save_model, optimizer, None, {"kl_coef": 0.1}, keep=keep)


def test_save_load_and_keep(tmp_path):
    for iteration in (2, 4, 6):
        _save(tmp_path, iteration)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004", "step-000006"]
    loaded = load_checkpoint_state(latest_checkpoint(tmp_path))
    assert loaded["state"] == {"kl_coef": 0.1, "iteration": 6}
    assert loaded["optimizer"]["state"][0]["step"].item() == 1


def test_damaged_checkpoint_is_detected(tmp_path):
    path = _save(tmp_path, 2)
    weights = path / "model" / "weights.pt"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"model/weights.pt is damaged"):
        load_checkpoint_state(path)
    (path / "checksums.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint_state(path)
