"""What ``generation.engine=vllm`` decides without an engine (no vLLM needed): which GPU a
rank's engine sees, which parallel layouts it refuses, how long its context is, and how the
worker's answer becomes the loop's rows."""

from __future__ import annotations

import pytest
import torch

from ppo_core.config import ConfigError, load_config
from ppo_core.experience.engines import (
    EngineError,
    check_engine,
    engine_context,
    engine_device_environment,
    responses_from_answer,
)
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


# -- the engine's answer as the loop's tensors ---------------------------------------------------

EOS = 2  # the stop id, and the pad id, as in a chat model that pads with its end-of-turn token


def _answer(rows: list[list[int]], finish: list[str]) -> dict:
    return {
        "tokens": rows,
        "logprobs": [[-0.5 - i for i in range(len(row))] for row in rows],
        "finish": finish,
    }


def test_a_row_is_what_the_engine_sampled_and_a_stop_only_where_one_was_drawn():
    """A short row in a wide batch whose pad id is the stop id: the mask covers exactly the
    tokens the worker returned, the pad after them is never counted as a stop, and
    ``has_eos`` is true only for rows whose last returned token is a stop id (vLLM reports
    'length' for a stop drawn as the last allowed token: still a stop)."""
    answer = _answer(
        [[5, 6, 7, 8, 9, 10], [5, EOS], [5, 6, 7, 8, 9, EOS], [5, 6, 7, EOS]],
        ["length", "stop", "length", "stop"],
    )
    ids, mask, has_eos, logprobs = responses_from_answer(answer, [EOS], 6, pad_token_id=EOS)
    assert mask.sum(dim=1).tolist() == [6, 2, 6, 4]
    assert has_eos.tolist() == [False, True, True, True]
    assert ids[1].tolist() == [5, EOS, EOS, EOS, EOS, EOS]  # padded, masked off
    assert logprobs[1].tolist() == [-0.5, -1.5, 0.0, 0.0, 0.0, 0.0]


def test_a_row_the_engines_context_cut_is_an_error_not_a_stop():
    """A row that ended before ``max_new_tokens`` without a stop id (vLLM's context was full)
    is refused: padded with the pad id, which is the stop id here, it would pass for a reply
    that stopped (the fault that taught a policy to stop where the engine cut)."""
    answer = _answer([[5, 6, 7, 8, 9, 10], [5, 6, 7]], ["length", "length"])
    with pytest.raises(EngineError, match=r"ended row 1 after 3 of generation.max_new_tokens=6"):
        responses_from_answer(answer, [EOS], 6, pad_token_id=EOS)


def test_the_engines_context_is_the_longest_prompt_plus_the_reply(tmp_path):
    """The context is sized from the prompts the stage holds, never from a validation
    setting, and one past the model's positions is refused naming both."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 128}')
    assert engine_context(tmp_path, 40, 64) == 104
    with pytest.raises(ConfigError, match=r"longest prompt \(100 tokens\) plus .*=64 is 164"):
        engine_context(tmp_path, 100, 64)
    (tmp_path / "config.json").write_text("{}")
    assert engine_context(tmp_path, 100, 64) == 164
