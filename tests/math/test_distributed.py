"""Two gloo processes with unequal token counts give the single-process mini-batch gradient."""

from __future__ import annotations

import pytest
import torch

from ppo_core import LOSS_AGG_MODES, whiten_advantages
from tests.helpers import free_port, spawn_ranks
from tests.math import dist_worker
from tests.math.toy import ToyPolicy, ppo_micro_loss, relative_error


@pytest.mark.distributed
def test_two_ranks_match_one_process(tmp_path):
    world_size = 2
    out = str(tmp_path / "result")
    spawn_ranks(dist_worker.run, world_size, world_size, f"tcp://127.0.0.1:{free_port()}", out)
    ranks = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(world_size)]
    data = dist_worker.shared_batch()
    # advantages are whitened with the moments of all ranks' rows together
    whole = whiten_advantages(data.advantages, data.response_mask)
    torch.testing.assert_close(
        torch.cat([r["whitened"] for r in ranks]), whole, rtol=1e-12, atol=1e-12
    )
    for mode in LOSS_AGG_MODES:
        model = ToyPolicy(seed=0)
        parts, _ = ppo_micro_loss(model, data, mode)
        (parts.total / parts.count).backward()
        expected = [p.grad for p in model.parameters()]
        local_counts = [r[mode]["local_count"] for r in ranks]
        if mode == "token-mean":
            assert local_counts[0] > 2 * local_counts[1], "the ranks' token counts should differ"
        for rank in ranks:
            assert rank[mode]["global_count"] == int(parts.count)
            assert relative_error(rank[mode]["grads"], expected) <= 1e-10, mode
            assert rank[mode]["loss"] == pytest.approx(
                (parts.total / parts.count).item(), rel=1e-10
            )
