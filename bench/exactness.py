"""Exactness of micro-batched PPO gradients on a tiny GPT-2, against the mean-of-means bug.

For one random PPO mini-batch (random response masks, some rows fully masked) this computes the
full mini-batch gradient once, then the gradient accumulated over micro-batches of every size,
both with ppo_core's exact normalisation and with the common mean of per-micro-batch means.
It prints the relative errors and writes them to ``bench/results/exactness.json``.

    .venv/bin/python bench/exactness.py [--batch 8] [--length 12] [--dtype float64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import GPT2Config, GPT2LMHeadModel

from ppo_core import (
    LOSS_AGG_MODES,
    accumulate_gradients,
    aggregate_loss,
    count_units,
    logprobs_from_logits,
    micro_batch_slices,
    policy_loss,
)


def make_batch(batch: int, length: int, vocab: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=gen)
    mask = torch.rand(batch, length, generator=gen) < 0.7
    mask[0] = False  # one fully masked row
    mask[1:3, length // 3 :] = False  # a few short responses
    return {
        "tokens": tokens,
        "mask": mask,
        "old_logprobs": torch.randn(batch, length, generator=gen, dtype=dtype) * 0.1 - 5.0,
        "advantages": torch.randn(batch, length, generator=gen, dtype=dtype),
    }


def rows(data: dict, index: slice) -> dict:
    return {k: v[index] for k, v in data.items()}


def micro_loss(model, mb: dict, mode: str):
    logits = model(mb["tokens"][:, :-1]).logits
    logprobs = logprobs_from_logits(logits, mb["tokens"][:, 1:])
    out = policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb["mask"], clip_eps=0.2)
    return aggregate_loss(out.token_losses, mb["mask"], mode), {}


def gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/exactness.json"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    config = GPT2Config(vocab_size=97, n_layer=2, n_embd=32, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config).to(dtype).eval()
    data = make_batch(args.batch, args.length, config.vocab_size, dtype, args.seed)

    table = Table(title=f"relative gradient error vs the full mini-batch ({args.dtype})")
    table.add_column("mode")
    table.add_column("micro_batch_size", justify="right")
    table.add_column("exact (ppo_core)", justify="right")
    table.add_column("mean of means", justify="right")
    results = []
    for mode in LOSS_AGG_MODES:
        model.zero_grad()
        parts, _ = micro_loss(model, data, mode)
        (parts.total / parts.count).backward()
        reference = gradient(model)
        for micro in range(1, args.batch + 1):
            slices = micro_batch_slices(args.batch, micro)
            model.zero_grad()
            accumulate_gradients(
                [rows(data, s) for s in slices],
                loss_fn=lambda mb, mode=mode: micro_loss(model, mb, mode),
                count_fn=lambda mb, mode=mode: count_units(mb["mask"], mode),
            )
            exact = ((gradient(model) - reference).abs().max() / reference.abs().max()).item()
            model.zero_grad()
            for s in slices:
                p, _ = micro_loss(model, rows(data, s), mode)
                # the common bug; an empty micro-batch contributes nothing instead of NaN here
                if p.count > 0:
                    (p.total / p.count / len(slices)).backward()
            naive = ((gradient(model) - reference).abs().max() / reference.abs().max()).item()
            results.append({"mode": mode, "micro_batch_size": micro, "exact": exact, "mean_of_means": naive})
            table.add_row(mode, str(micro), f"{exact:.1e}", f"{naive:.1e}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"dtype": args.dtype, "batch": args.batch, "results": results}, indent=1))
    worst = max(r["exact"] for r in results)
    print(f"worst exact relative error: {worst:.2e}; results in {args.out}")


if __name__ == "__main__":
    main()
