import pytest
import torch

from ppo_core.modeling.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint_state,
    remove_partial,
    save_checkpoint,
)


def _save(folder, iteration, keep=2):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()

    def save_model(path):
        path.mkdir()
        torch.save(model.state_dict(), path / "weights.pt")

    return save_checkpoint(
        folder, iteration, save_model, optimizer.state_dict(), None, {"kl_coef": 0.1}, keep=keep
    )


def test_save_load_and_keep(tmp_path):
    for iteration in (2, 4, 6):
        _save(tmp_path, iteration)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004", "step-000006"]
    loaded = load_checkpoint_state(list_checkpoints(tmp_path)[-1])
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


def test_partial_folders_of_killed_writers_are_removed(tmp_path):
    good = _save(tmp_path, 2)
    for name in (".step-000004.tmp-x1y2", ".step-000002.old-77", ".step-000000.discard-8"):
        (tmp_path / name).mkdir()
    (tmp_path / ".lock").write_text("")  # not a checkpoint writer's: left alone
    assert remove_partial(tmp_path) == [
        ".step-000000.discard-8",
        ".step-000002.old-77",
        ".step-000004.tmp-x1y2",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", good.name]
    assert remove_partial(tmp_path / "missing") == []
