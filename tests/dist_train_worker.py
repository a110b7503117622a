"""Worker for the data-parallel training test: one rank of `train` under torch.distributed."""

from __future__ import annotations

import os

from tests.helpers import end_rank


def run(rank: int, world_size: int, port: int, overrides: list[str]) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
        }
    )
    import torch.distributed as dist

    from ppo_core.config import load_config
    from ppo_core.training.loop import train

    try:
        train(load_config(overrides=overrides))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    end_rank()


def shard_a_model(
    rank: int, world_size: int, port: int, model_dir: str, precision: str, out: str
) -> None:
    """Load and shard the model in ``model_dir`` as a ``fsdp`` run does (rank 0 reads the
    weights, rank 1 builds the structure on the meta device and receives its shards) and
    record, per rank: the largest difference of its logits from the unsharded model's, the
    dtype a block's weight has during the forward pass, and the dtype of its shard. Then sample
    from it inside ``strategy.gathered`` as the rollout does, and run a forward and backward
    pass as the update does: ``states`` holds :func:`sharded_state` before, during and after
    sampling, and after that forward pass and its backward pass."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)})
    import json

    import torch
    import torch.distributed as dist

    from ppo_core.config import GenerationConfig
    from ppo_core.experience.sampling import sample_responses
    from ppo_core.models.causal_lm import load_tokenizer, transformer_blocks
    from ppo_core.models.policy import load_causal_lm
    from ppo_core.parallel.process_group import DataParallel
    from ppo_core.parallel.runtime import Runtime
    from ppo_core.parallel.strategies import make_strategy

    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    with torch.no_grad():  # every rank computes the reference logits alone, before sharding
        expected = load_causal_lm(model_dir, "policy")(input_ids=ids).logits
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        parallel = DataParallel(rank, world_size)
        strategy = make_strategy("fsdp", parallel, torch.device("cpu"), precision)
        model = strategy.load(lambda: load_causal_lm(model_dir, "policy"))
        block = transformer_blocks(model)[0]  # found by class, which sharding renames
        strategy.wrap_reference(model)
        weight = next(block.parameters())
        seen: list[str] = []
        block.register_forward_pre_hook(
            lambda module, args: seen.append(str(next(module.parameters()).dtype))
        )
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        record = {
            "logit_difference": float((logits - expected).abs().max()),
            "computed": sorted(set(seen)),
            "shard": str(weight.to_local().dtype),
        }
        states = {"before": sharded_state(model)}
        torch.manual_seed(rank)
        with strategy.gathered(model):
            sample_responses(
                model,
                load_tokenizer(model_dir),
                ["The movie was", "This film"],
                GenerationConfig(max_new_tokens=4),
                Runtime(parallel=parallel),
                chunk_size=2,
            )
            states["during"] = sharded_state(model)
        states["after"] = sharded_state(model)
        loss = model(input_ids=ids).logits.float().square().mean()
        states["update_forward"] = sharded_state(model)  # resharded after its forward pass
        loss.backward()
        states["update_backward"] = sharded_state(model)
        with open(f"{out}.{rank}", "w") as handle:
            json.dump({**record, "states": states}, handle)
    finally:
        dist.destroy_process_group()
    end_rank()  # before the sharded model is freed


def sharded_state(model) -> dict[str, int]:
    """How many of ``model``'s parameters are shards (DTensors) and how many are whole tensors:
    FSDP2 swaps a module's shards for whole tensors while it is gathered, and back when it
    reshards."""
    from torch.distributed.tensor import DTensor

    kinds = [isinstance(p, DTensor) for p in model.parameters()]
    return {"shards": sum(kinds), "whole": len(kinds) - sum(kinds)}
