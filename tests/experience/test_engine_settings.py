"""What ``generation.engine=vllm`` decides before any engine starts (no vLLM needed): which GPU
a rank's engine sees, and which parallel layouts it refuses."""

from __future__ import annotations

import pytest
import torch

from ppo_core.config import ConfigError, load_config
from ppo_core.experience.engines import EngineError, check_engine, engine_device_environment
from ppo_core.parallel.process_group import DataParallel
from ppo_core.parallel.runtime import Runtime


def test_a_ranks_engine_sees_the_ranks_own_gpu():
    """Rank 1 on ``cuda:1`` gets the second GPU the launcher made visible (torch counts the
    visible ones from 0), so vLLM's ``cuda:0`` is the trainer's device; a CPU engine gets
    nothing."""
    assert engine_device_environment(torch.device("cpu"), {}) == {}
    assert engine_device_environment(torch.device("cuda", 1), {}) == {"CUDA_VISIBLE_DEVICES": "1"}
    visible = {"CUDA_VISIBLE_DEVICES": "4, 6,7"}
    assert engine_device_environment(torch.device("cuda", 0), visible) == {
        "CUDA_VISIBLE_DEVICES": "4"
    }
    assert engine_device_environment(torch.device("cuda", 2), visible) == {
        "CUDA_VISIBLE_DEVICES": "7"
    }
    with pytest.raises(EngineError, match=r"cuda:3 is not among CUDA_VISIBLE_DEVICES='4, 6,7'"):
        engine_device_environment(torch.device("cuda", 3), visible)


def test_sharded_ranks_are_refused_and_replicated_ones_are_not(tmp_path):
    """FSDP ranks hold the policy in shards, which no engine can load: refused by name. DDP
    ranks each start an engine of their own: let through (to the check of the engine's
    Python, which names its key)."""
    two_ranks = Runtime(parallel=DataParallel(rank=0, world_size=2))
    missing = tmp_path / "python"

    def config(strategy: str):
        return load_config(
            overrides=[
                "generation.engine=vllm",
                f"generation.vllm_python={missing}",
                f"parallel.strategy={strategy}",
            ]
        )

    with pytest.raises(ConfigError, match=r"parallel.strategy=fsdp holds in shards"):
        check_engine(config("fsdp"), two_ranks)
    with pytest.raises(EngineError, match=r"generation.vllm_python="):
        check_engine(config("ddp"), two_ranks)
    with pytest.raises(EngineError, match=r"generation.vllm_python="):
        check_engine(config("fsdp"), Runtime())  # one process: nothing is sharded
