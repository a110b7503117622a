"""Step 3 of the run (layer 3): which checkpoint, if any, continues this very run. A
checkpoint of another config or data version is set aside (``checkpoints/stale-*``), never
resumed from and never deleted at once."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ppo_core.checkpoints.store import (
    list_checkpoints,
    load_latest_good,
    remove_partial,
)
from ppo_core.config import Config, flatten
from ppo_core.files import discard
from ppo_core.parallel.runtime import Runtime

RESUME_FREE_KEYS = (
    "train.iterations",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.keep_set_aside",
    "train.resume",
    "train.allow_stale_data",
    "train.gradient_checkpointing",
    "model.lora.merge",
    "model.reward_timeout",
    "threads",
    "ppo.scoring_batch_size",
    "eval.",
    "promote.",
    "schedule.",
    "flow.",
    "validation.",
    "parallel.",
    "generation.vllm_",  # where the engine's environment is and the memory it may take
)


# Sizes given per data-parallel rank: a checkpoint continues a run with the same global sizes
# (the value times the world size), whatever the number of ranks.
PER_RANK_KEYS = ("ppo.rollout_batch_size", "ppo.mini_batch_size")


def resume_mismatch(
    config: Config,
    state: dict[str, Any],
    data_hash: str | None,
    world_size: int = 1,
    base_sha256: str | None = None,
) -> str | None:
    """Why a checkpoint cannot continue this run (another config, data version or base model),
    or None. A checkpoint that records no base fingerprint (written before it was recorded)
    cannot show that it was trained from this run's base, so it does not continue it either."""
    if state.get("data_hash") != data_hash:
        return f"it was trained on data version {state.get('data_hash')}, this run has {data_hash}"
    recorded_base = state.get("base_sha256")
    if recorded_base is None and base_sha256 is not None:
        return (
            "it records no fingerprint of the model.policy it was trained from (a checkpoint "
            f"from before they were recorded), so it may be of another base than {config.model.policy}"
        )
    if recorded_base is not None and base_sha256 is not None and recorded_base != base_sha256:
        return (
            f"it was trained from another model.policy (fingerprint {str(recorded_base)[:12]}, "
            f"{config.model.policy} now has {base_sha256[:12]}: a new base, e.g. the next "
            "generation's)"
        )
    now = flatten(config)
    # a key the checkpoint does not record came after it was written, and new keys default to
    # what the code did before them: it counts at its default (upgrades resume)
    before = {**_defaults(), **flatten(OmegaConf.create(state.get("config", "{}")))}
    before_ranks = int(state.get("world_size", 1))
    old_per_rank = {key: before.get(key) for key in PER_RANK_KEYS}
    for key in PER_RANK_KEYS:
        if isinstance(before.get(key), int) and isinstance(now.get(key), int):
            before[key] = f"{before[key] * before_ranks} in all"
            now[key] = f"{now[key] * world_size} in all"
    changed = sorted(
        k
        for k in before.keys() | now.keys()
        if before.get(k) != now.get(k) and not k.startswith(RESUME_FREE_KEYS)
    )
    if changed:
        return (
            "its config differs in "
            + ", ".join(f"{k} ({before.get(k)!r} -> {now.get(k)!r})" for k in changed[:5])
            + _per_rank_hint(old_per_rank, changed, before_ranks, world_size)
        )
    if int(state["iteration"]) > config.train.iterations:
        return f"it is at iteration {state['iteration']}, past train.iterations={config.train.iterations}"
    return None


def _defaults() -> dict[str, Any]:
    return flatten(Config())


def _per_rank_hint(
    old: dict[str, Any], changed: list[str], before_ranks: int, world_size: int
) -> str:
    """For per-rank sizes (``old``: the checkpoint's values) that changed only because the
    number of ranks did: the per-rank value that continues the old run on this many ranks, or
    why none does."""
    if before_ranks == world_size:
        return ""
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    hints = []
    for key in PER_RANK_KEYS:
        if key not in changed or not isinstance(old.get(key), int):
            continue
        total = old[key] * before_ranks
        if total % world_size:
            hints.append(f"{key}: the old run's {total} in all does not divide over {ranks}")
        else:
            hints.append(f"{key}={total // world_size} continues it on {ranks}")
    return f" ({'; '.join(hints)})" if hints else ""


def set_aside_checkpoints(checkpoint_dir: str | Path, keep: int) -> tuple[Path, list[Path]]:
    """Move the checkpoints of another run to ``stale-<time>/`` and keep the newest ``keep``
    such folders; returns the new folder and the removed ones."""
    folder = Path(checkpoint_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stale = folder / f"stale-{stamp}"
    number = 1
    while stale.exists():  # two restarts within one second
        number += 1
        stale = folder / f"stale-{stamp}-{number}"
    stale.mkdir(parents=True)
    for path in list_checkpoints(folder):
        path.rename(stale / path.name)
    set_aside = sorted(p for p in folder.glob("stale-*") if p.is_dir())
    removed = set_aside[: max(len(set_aside) - keep, 0)]
    for old in removed:
        discard(old)
    return stale, removed


def resolve_resume(
    config: Config, runtime: Runtime, data_hash: str | None, base_sha256: str | None = None
) -> dict[str, Any] | None:
    """The newest good checkpoint that continues this run (same config and data), or None.

    Called under the run lock. What a killed run left half-written is removed first; a damaged
    checkpoint is skipped for the previous good one; checkpoints of another config or data
    version are set aside (moved, never deleted) and the run starts over.
    """
    parallel = runtime.parallel
    if parallel.is_main:
        for name in remove_partial(config.train.checkpoint_dir):
            warnings.warn(f"removed {name}, left half-written by an interrupted run", stacklevel=3)
    if not config.train.resume:
        return None
    folder, checkpoint, damaged = load_latest_good(config.train.checkpoint_dir)
    for problem in damaged:
        warnings.warn(f"skipping damaged checkpoint {problem}", stacklevel=3)
    if checkpoint is None:
        return None
    reason = resume_mismatch(
        config, checkpoint["state"], data_hash, runtime.parallel.world_size, base_sha256
    )
    if reason is None:
        return checkpoint
    parallel.barrier()  # every rank has read the checkpoint list before it moves
    if parallel.is_main:
        keep = config.train.keep_set_aside
        stale, removed = set_aside_checkpoints(config.train.checkpoint_dir, keep)
        kept = f"moved to {stale}" if keep else "removed (train.keep_set_aside=0)"
        dropped = (
            f"; removed the oldest set-aside runs {', '.join(p.name for p in removed)} "
            f"(train.keep_set_aside={keep})"
            if removed and keep
            else ""
        )
        warnings.warn(
            f"not resuming from {folder}: {reason}; training starts over from model.policy and "
            f"the old checkpoints were {kept}{dropped}. To continue the old run instead, undo "
            "the change",
            stacklevel=3,
        )
    return None
