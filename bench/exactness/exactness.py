"""Exactness of micro-batched PPO gradients on a tiny GPT-2, against the mean-of-means bug.

For one random PPO mini-batch (random response masks, some rows fully masked) this computes the
full mini-batch gradient once, then the gradient accumulated over micro-batches of every size,
both with ppo_core's exact normalisation and with the common mean of per-micro-batch means.
It prints the relative errors and writes them to ``bench/results/exactness.json``.

    .venv/bin/python -m bench.exactness.exactness [--batch 8] [--length 12] [--dtype float64]
    .venv/bin/python -m bench.exactness.exactness --smoke    # 3 rows x 4 tokens, to a temporary folder
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import GPT2Config, GPT2LMHeadModel

from ppo_core import LOSS_AGG_MODES, PPOObjective, accumulate_gradients, micro_batch_slices
from ppo_core.models.policy import ActorCritic
from ppo_core.models.scoring import score_sequences

PROMPT_LENGTH = 4


def make_batch(batch: int, length: int, vocab: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) < 0.7
    mask[0] = False  # one fully masked row
    mask[1:3, length // 3 :] = False  # a few short responses

    def floats(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(batch, length, generator=gen, dtype=dtype) * scale

    return {
        "prompt_ids": torch.randint(0, vocab, (batch, PROMPT_LENGTH), generator=gen),
        "prompt_mask": torch.ones(batch, PROMPT_LENGTH, dtype=torch.long),
        "response_ids": torch.randint(0, vocab, (batch, length), generator=gen),
        "response_mask": mask,
        "old_logprobs": floats(0.1) - 5.0,
        "old_values": floats(),
        "advantages": floats(),
        "returns": floats(),
    }


def rows(data: dict, index: slice) -> dict:
    return {k: v[index] for k, v in data.items()}


def micro_loss(model, mb: dict, objective: PPOObjective):
    """The trainer's objective (policy, clipped value and entropy terms) on one micro-batch."""
    out = score_sequences(
        model,
        mb["prompt_ids"],
        mb["prompt_mask"],
        mb["response_ids"],
        mb["response_mask"],
        with_entropy=True,
        entropy_grad=True,
    )
    return objective(
        out.logprobs,
        out.values,
        out.entropy,
        mb["old_logprobs"],
        mb["old_values"],
        mb["advantages"],
        mb["returns"],
        mb["response_mask"],
    )


def gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


TOY_GPT2 = dict(
    vocab_size=97,
    n_layer=2,
    n_embd=32,
    n_head=4,
    n_positions=64,
    bos_token_id=0,
    eos_token_id=0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
"""The model whose gradients are compared: 2 layers x 32, no dropout (so passes repeat)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/exactness.json"))
    from bench import common

    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.length = 3, 4
        args.out = common.output_folder("exactness") / "exactness.json"
    dtype = getattr(torch, args.dtype)

    config = GPT2Config(**TOY_GPT2)
    torch.manual_seed(args.seed)
    model = ActorCritic(GPT2LMHeadModel(config), torch.nn.Linear(config.n_embd, 1)).to(dtype).eval()
    data = make_batch(args.batch, args.length, config.vocab_size, dtype, args.seed)

    table = Table(title=f"relative gradient error vs the full mini-batch ({args.dtype})")
    table.add_column("mode")
    table.add_column("micro_batch_size", justify="right")
    table.add_column("exact (ppo_core)", justify="right")
    table.add_column("mean of means", justify="right")
    results = []
    for mode in LOSS_AGG_MODES:
        objective = PPOObjective(
            clip_eps=0.2, clip_eps_value=0.2, vf_coef=0.5, entropy_coef=0.01, loss_agg_mode=mode
        )
        model.zero_grad()
        parts, _ = micro_loss(model, data, objective)
        (parts.total / parts.count).backward()
        reference = gradient(model)
        for micro in range(1, args.batch + 1):
            slices = micro_batch_slices(args.batch, micro)
            model.zero_grad()
            accumulate_gradients(
                [rows(data, s) for s in slices],
                loss_fn=lambda mb, objective=objective: micro_loss(model, mb, objective),
                count_fn=lambda mb, objective=objective: objective.count(mb["response_mask"]),
            )
            exact = ((gradient(model) - reference).abs().max() / reference.abs().max()).item()
            model.zero_grad()
            for s in slices:
                p, _ = micro_loss(model, rows(data, s), objective)
                # the common bug; an empty micro-batch contributes nothing instead of NaN here
                if p.count > 0:
                    (p.total / p.count / len(slices)).backward()
            naive = ((gradient(model) - reference).abs().max() / reference.abs().max()).item()
            results.append(
                {"mode": mode, "micro_batch_size": micro, "exact": exact, "mean_of_means": naive}
            )
            table.add_row(mode, str(micro), f"{exact:.1e}", f"{naive:.1e}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "dtype": args.dtype,
                "batch": args.batch,
                "results": results,
                "machine": common.machine(),
            },
            indent=1,
        )
    )
    worst = max(r["exact"] for r in results)
    print(f"worst exact relative error: {worst:.2e}; results in {args.out}")


if __name__ == "__main__":
    main()
