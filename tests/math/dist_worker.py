"""Worker for the data-parallel exactness test (run by torch.multiprocessing.spawn)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ppo_core import (
    LOSS_AGG_MODES,
    accumulate_gradients,
    count_units,
    micro_batch_slices,
    whiten_advantages,
)
from tests.helpers import end_rank
from tests.math.toy import ToyPolicy, ppo_micro_loss, random_batch

BATCH, LENGTH, SEED = 8, 6, 11


def shared_batch():
    """The mini-batch both ranks agree on; rank 1's half holds far fewer valid tokens, and one of
    its rows is empty."""
    data = random_batch(SEED, BATCH, LENGTH, torch.float64, p_valid=0.9, empty_rows=(5,))
    data.response_mask[4:, 2:] = False
    return data


def run(rank: int, world_size: int, init_method: str, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        data = shared_batch()
        shard = data.rows(slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size))
        # Different micro-batch sizes per rank: 1 row on rank 0, 3 rows on rank 1.
        micro = 1 if rank == 0 else 3
        results = {}
        for mode in LOSS_AGG_MODES:
            model = DistributedDataParallel(ToyPolicy(seed=0))
            micro_batches = [shard.rows(s) for s in micro_batch_slices(len(shard), micro)]
            result = accumulate_gradients(
                micro_batches,
                loss_fn=lambda mb, model=model, mode=mode: ppo_micro_loss(model, mb, mode),
                count_fn=lambda mb, mode=mode: count_units(mb.response_mask, mode),
                no_sync=model.no_sync,
            )
            results[mode] = {
                "grads": [p.grad.clone() for p in model.module.parameters()],
                "loss": result.loss.all_reduce().item(),
                "global_count": result.global_count,
                "local_count": result.local_count,
            }
        results["whitened"] = whiten_advantages(
            shard.advantages, shard.response_mask, all_ranks=True
        )
        torch.save(results, f"{out_path}.{rank}")
        dist.destroy_process_group()
    except BaseException:
        dist.destroy_process_group()
        raise
    end_rank()  # before the last model and its reducer are freed
