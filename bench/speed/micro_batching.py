"""Memory and time of one exact mini-batch update as the mini-batch grows at fixed micro-batch.

Each configuration runs in a fresh process: it builds a GPT-2 (default 4 layers x 256, the
tiny default's 942-token vocabulary) with a value head, a random PPO mini-batch (8 prompt + 16
response tokens, random response masks), and runs ``--steps`` exact accumulated updates
(``accumulate_gradients`` + AdamW). Peak memory is the growth of the process's peak resident
set (``ru_maxrss``) over its value after one warm-up update of a single row; time is the
median seconds per update. Writes ``bench/results/micro_batching.json``.

    .venv/bin/python -m bench.speed.micro_batching [--micro 8] [--minis 8 16 32 64 128]
    .venv/bin/python -m bench.speed.micro_batching --smoke  # 1 layer x 32, mini 8, to a temporary folder
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def synthetic_batch(rows: int) -> dict:
    """A rollout batch of ``rows`` rows for the tiny GPT-2 of :func:`child`: 8 prompt tokens,
    16 response tokens (about 80% of them unmasked), seeded by ``rows``."""
    import torch

    gen = torch.Generator().manual_seed(rows)
    mask = torch.rand(rows, 16, generator=gen) < 0.8
    return {
        "prompt_ids": torch.randint(3, 942, (rows, 8), generator=gen),
        "prompt_mask": torch.ones(rows, 8, dtype=torch.long),
        "response_ids": torch.randint(3, 942, (rows, 16), generator=gen),
        "response_mask": mask,
        "old_logprobs": torch.full((rows, 16), -7.0),
        "advantages": torch.randn(rows, 16, generator=gen),
        "old_values": torch.zeros(rows, 16),
        "returns": torch.randn(rows, 16, generator=gen),
    }


def child(mini: int, micro: int, layers: int, hidden: int, steps: int) -> dict[str, float]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from ppo_core import PPOObjective, accumulate_gradients, micro_batch_slices
    from ppo_core.models.policy import ActorCritic
    from ppo_core.models.scoring import score_sequences

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = GPT2Config(
        vocab_size=942,
        n_layer=layers,
        n_embd=hidden,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = ActorCritic(GPT2LMHeadModel(config), torch.nn.Linear(hidden, 1)).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    objective = PPOObjective(clip_eps=0.2, clip_eps_value=0.2, vf_coef=0.1)  # the defaults

    def loss_fn(mb):
        out = score_sequences(
            model, mb["prompt_ids"], mb["prompt_mask"], mb["response_ids"], mb["response_mask"]
        )
        return objective(
            out.logprobs,
            out.values,
            None,
            mb["old_logprobs"],
            mb["old_values"],
            mb["advantages"],
            mb["returns"],
            mb["response_mask"],
        )

    def update(data, micro_size):
        optimizer.zero_grad(set_to_none=True)
        micro_batches = [
            {k: v[s] for k, v in data.items()}
            for s in micro_batch_slices(len(data["prompt_ids"]), micro_size)
        ]
        accumulate_gradients(
            micro_batches, loss_fn, lambda mb: objective.count(mb["response_mask"])
        )
        optimizer.step()

    update(synthetic_batch(1), 1)  # warm-up: optimizer state and allocator at a one-row shape
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    data = synthetic_batch(mini)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        update(data, micro)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "mini": mini,
        "micro": micro,
        "peak_growth_mb": (peak - before) / 1024,
        "seconds_per_update": statistics.median(times),
    }


def measure(mini: int, micro: int, args) -> dict[str, float]:
    """One configuration in a fresh process; a configuration measured already (the split
    configuration can also be one of the mini-batch sweep's) is not run again."""
    key = (mini, micro)
    if key not in MEASURED:
        MEASURED[key] = run_child(mini, micro, args)
    return MEASURED[key]


MEASURED: dict[tuple[int, int], dict[str, float]] = {}


def run_child(mini: int, micro: int, args) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            __spec__.name,
            "--child",
            str(mini),
            str(micro),
            "--layers",
            str(args.layers),
            "--hidden",
            str(args.hidden),
            "--steps",
            str(args.steps),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--minis", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", type=int, nargs=2, metavar=("MINI", "MICRO"))
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "micro_batching.json"
    )
    from bench import common

    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.layers, args.hidden, args.steps)))
        return
    if args.smoke:  # two processes: mini 8 at micro 1 (the split too), and at micro 8
        args.micro, args.minis, args.layers, args.hidden, args.steps = 1, [8], 1, 32, 1
        args.out = common.output_folder("micro_batching") / "micro_batching.json"
    memory = [measure(mini, args.micro, args) for mini in args.minis]
    print(f"fixed micro_batch_size={args.micro}, GPT-2 {args.layers} x {args.hidden}")
    print(f"{'mini':>6} {'peak growth MB':>15} {'s / update':>11}")
    for row in memory:
        print(f"{row['mini']:>6} {row['peak_growth_mb']:>15.1f} {row['seconds_per_update']:>11.3f}")
    largest = max(args.minis)
    split = measure(largest, largest // 8, args)
    whole = measure(largest, largest, args)
    overhead = split["seconds_per_update"] / whole["seconds_per_update"]
    print(
        f"mini={largest}: micro={largest // 8} takes {split['seconds_per_update']:.3f} s, "
        f"micro={largest} takes {whole['seconds_per_update']:.3f} s ({overhead:.2f}x); "
        f"peak growth {split['peak_growth_mb']:.1f} vs {whole['peak_growth_mb']:.1f} MB"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "memory": memory,
                "split": split,
                "whole": whole,
                "overhead": overhead,
                "machine": common.machine(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
