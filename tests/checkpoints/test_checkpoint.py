import json

import pytest
import torch

from ppo_core.checkpoints.sharded import load_sharded_checkpoint, save_sharded_checkpoint
from ppo_core.checkpoints.store import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint_state,
    load_latest_good,
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


def _trained(seed: int, width: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(2, width), torch.nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 2)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def _save_sharded(folder, iteration, model, optimizer):
    return save_sharded_checkpoint(
        folder,
        iteration,
        model,
        optimizer,
        lambda path: path.mkdir(),
        None,
        {"kl_coef": 0.1},
    )


def test_a_sharded_checkpoint_restores_weights_and_optimizer_state(tmp_path):
    """Written in one process here (the 2-rank cases are in tests/parallel/test_distributed_training.py):
    the DCP shards hold every weight and every AdamW moment and step, and the checksums cover
    them."""
    model, optimizer = _trained(0)
    path = _save_sharded(tmp_path, 3, model, optimizer)
    loaded = load_checkpoint_state(path)
    assert loaded["sharded"] == path and loaded["model_dir"] is None
    assert loaded["state"]["checkpoint_format"] == "sharded"
    sums = json.loads((path / "checksums.json").read_text())
    assert "shards/.metadata" in sums and any(name.endswith(".distcp") for name in sums)

    fresh, fresh_optimizer = _trained(1)
    load_sharded_checkpoint(path, fresh, fresh_optimizer)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    saved, restored = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["param_groups"] == restored["param_groups"]
    for index, entries in saved["state"].items():
        for key, value in entries.items():
            assert torch.equal(restored["state"][index][key], value), (index, key)


def test_a_damaged_shard_is_skipped_for_the_previous_checkpoint(tmp_path):
    model, optimizer = _trained(0)
    _save_sharded(tmp_path, 1, model, optimizer)
    newest = _save_sharded(tmp_path, 2, model, optimizer)
    shard = next((newest / "shards").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    folder, state, problems = load_latest_good(tmp_path)
    assert folder is not None and folder.name == "step-000001"
    assert state is not None and state["state"]["iteration"] == 1
    assert problems and f"shards/{shard.name} is damaged" in problems[0]


def test_a_sharded_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    model, optimizer = _trained(0)
    path = _save_sharded(tmp_path, 1, model, optimizer)
    wider, wider_optimizer = _trained(0, width=5)
    before = [value.clone() for value in wider.state_dict().values()]
    with pytest.raises(CheckpointError, match=r"step-000001 holds 0.weight of shape \(3, 2\)"):
        load_sharded_checkpoint(path, wider, wider_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, wider.state_dict().values(), strict=True))
