"""Worker for the data-parallel training test: one rank of `train` under torch.distributed."""

from __future__ import annotations

import os


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
    from ppo_core.trainer import train

    try:
        train(load_config(overrides=overrides))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
