"""A rank of the two-rank pairwise-gradient test: its share of one mini-batch, accumulated."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers import end_rank


def shared_pairs(vocab: int, count: int = 7):
    """The mini-batch both the ranks and the single process see: pairs of unequal lengths."""
    from ppo_core.preference.pairs import TokenisedPair

    generator = torch.Generator().manual_seed(5)
    pairs = []
    for i in range(count):
        lengths = (3 + (5 * i) % 9, 2 + (3 * i) % 7)
        ids = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
        pairs.append(TokenisedPair(ids[0], ids[1]))
    return pairs


def classifier(folder, dtype=torch.float64):
    from ppo_core.rewards.classifier import new_reward_classifier

    return new_reward_classifier(folder, pad_token_id=0, seed=3).to(dtype)


def run(rank: int, world_size: int, address: str, folder: str, out: str) -> None:
    from ppo_core.preference.training import accumulate_pair_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size)
    model = classifier(folder)
    pairs = shared_pairs(model.config.vocab_size)
    # unequal shares: rank 0 holds 5 pairs in micro-batches of 2, rank 1 holds 2 in one
    mine = pairs[:5] if rank == 0 else pairs[5:]
    size = 2 if rank == 0 else 3
    micro = [mine[i : i + size] for i in range(0, len(mine), size)]
    result = accumulate_pair_gradients(model, micro, 0, 0.5, torch.device("cpu"))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"grads": grads, "global_count": result.global_count}, f"{out}.{rank}")
    dist.barrier()
    end_rank()
