"""The run's randomness (layer 3): named streams seeded afresh per iteration, so that a run
resumed from a checkpoint draws the same prompts, samples and shuffles as an uninterrupted one."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TypeVar

import torch

from ppo_core.config import Config
from ppo_core.parallel.process_group import DataParallel

Row = TypeVar("Row")
"""A prompt, or the row of reference fields that goes with it."""


class RandomStream(enum.IntEnum):
    """The run's independent random streams; each is seeded afresh every iteration."""

    PROMPT_DRAW = 0
    """Which training prompts an iteration samples (with replacement)."""
    SAMPLING = 1
    """Token sampling in ``generate``, one seed per generation chunk."""
    SHUFFLE = 2
    """The order of rollout rows in the mini-batches of every epoch."""


def stream_seed(seed: int, iteration: int, stream: RandomStream, chunk: int = 0) -> int:
    """A distinct, reproducible seed for each (run seed, iteration, stream, generation chunk)."""
    code = int(stream) + 1000 * chunk
    return (seed * 1_000_003 + iteration * 7_919 + code * 104_729) % (2**63 - 1)


def draw_prompts(
    train_prompts: Sequence[Row], config: Config, iteration: int, parallel: DataParallel
) -> list[Row]:
    """This rank's rows of the iteration's global prompt batch: prompts drawn with replacement,
    each repeated ``ppo.samples_per_prompt`` times in consecutive rows. The per-rank batch is a
    multiple of the group size, so every group lies whole on one rank, where its advantages are
    computed (docs/design.md section 4). The draw depends on the number of rows alone, so the
    same call on the prompts' reference fields draws the same rows."""
    draw = torch.Generator().manual_seed(
        stream_seed(config.seed, iteration, RandomStream.PROMPT_DRAW)
    )
    group = config.ppo.samples_per_prompt
    global_size = config.ppo.rollout_batch_size * parallel.world_size
    picks = torch.randint(len(train_prompts), (global_size // group,), generator=draw)
    picks = picks.repeat_interleave(group)
    first, last = parallel.rows(config.ppo.rollout_batch_size)
    return [train_prompts[i] for i in picks[first:last].tolist()]


def sampling_seeds(config: Config, iteration: int, parallel: DataParallel) -> list[int]:
    """One seed per generation chunk of this rank, numbered across ranks, so that the same
    global batch samples the same responses on any number of ranks (when the chunk size divides
    the per-rank batch)."""
    per_rank = config.ppo.rollout_batch_size
    chunk = config.ppo.generation_batch_size or per_rank
    chunks = -(-per_rank // chunk)
    return [
        stream_seed(config.seed, iteration, RandomStream.SAMPLING, parallel.rank * chunks + k)
        for k in range(chunks)
    ]


# -- setup ----------------------------------------------------------------------------------------
