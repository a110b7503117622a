"""Per-rank memory and time of one PPO iteration: DDP against FSDP, 1 and 2 ranks (gloo, CPU).

A random-weight Llama-style model (the ``100M`` shape of ``bench/memory_scaling.py``: hidden
768, 14 layers, vocabulary 512, 99.9M parameters) runs one PPO iteration of full fine-tuning
under ``torchrun --nproc_per_node R`` with ``parallel.strategy`` ``ddp`` or ``fsdp``: global
rollout batch 8 (8 / R per rank), mini-batch 8 / R per rank, micro-batch 4, 1 epoch, 16 new
tokens, 1 thread per rank. Each rank reports its peak resident set (``ru_maxrss``, so the
interpreter, loading, the rollout, the update and the saving of a checkpoint and the candidate
are included) and the iteration's ``perf/rollout_s`` and ``perf/update_s``. FSDP's rollout
includes gathering the policy whole once (``ParallelStrategy.gathered``). Writes
``bench/results/sharding.json``.

    .venv/bin/python bench/sharding.py [--ranks 1 2] [--strategies ddp fsdp]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 14}


def varied_reward(prompts: list, responses: list[str]) -> torch.Tensor:
    """A score that varies over random text, so that the update is not zero."""
    return torch.tensor([(sum(map(ord, r)) % 11) / 10.0 for r in responses])


def rank_main(args: argparse.Namespace) -> None:
    """One rank of a torchrun launch: one iteration, then this rank's numbers on stdout."""
    from ppo_core.config import load_config
    from ppo_core.trainer import train

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    work = Path(args.work)
    out = work / f"out-{args.strategy}-{ranks}"  # a run of its own: nothing to resume from
    summary = train(
        load_config(
            overrides=[
                f"model.policy={work / 'model'}",
                f"data.train_file={work / 'train.jsonl'}",
                f"train.output_dir={out / 'candidate'}",
                f"train.checkpoint_dir={out / 'checkpoints'}",
                "train.resume=false",
                "train.iterations=1",
                f"ppo.rollout_batch_size={8 // ranks}",
                f"ppo.mini_batch_size={8 // ranks}",
                f"ppo.micro_batch_size={min(4, 8 // ranks)}",
                "ppo.epochs=1",
                "generation.max_new_tokens=16",
                "threads=1",
                "device=cpu",
                "model.reward=bench.sharding:varied_reward",
                f"parallel.strategy={args.strategy}",
            ]
        )
    )
    metrics = summary.history[0]
    print(
        "RANK "
        + json.dumps(
            {
                "rank": int(os.environ.get("RANK", "0")),
                "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
                "rollout_s": metrics["perf/rollout_s"],
                "update_s": metrics["perf/update_s"],
            }
        ),
        flush=True,
    )


def build(work: Path) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ppo_core.modeling.review_grammar import default_prompts, generate_review_corpus
    from ppo_core.modeling.tiny_default import train_tokenizer

    tokenizer = train_tokenizer(generate_review_corpus(500, seed=0), vocab_size=512)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        num_attention_heads=SHAPE["hidden_size"] // 64,
        num_key_value_heads=SHAPE["hidden_size"] // 64,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SHAPE,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(work / "model", safe_serialization=True)
    tokenizer.save_pretrained(work / "model")
    prompts = default_prompts(64, seed=0)
    (work / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sharding.json")
    parser.add_argument("--rank-of", dest="work", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.work:
        rank_main(args)
        return
    sys.path.insert(0, str(ROOT))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
    }
    runs = []
    with tempfile.TemporaryDirectory(prefix="sharding-") as tmp:
        work = Path(tmp)
        params = build(work)
        torchrun = Path(sys.executable).with_name("torchrun")
        for ranks in args.ranks:
            for strategy in args.strategies:
                if strategy == "fsdp" and ranks == 1:
                    continue  # nothing to shard over (refused by key)
                done = subprocess.run(
                    [str(torchrun), "--nproc_per_node", str(ranks), "--master-port", "29533",
                     __file__, "--rank-of", str(work), "--strategy", strategy],
                    cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                )  # fmt: skip
                found = [
                    json.loads(line[len("RANK ") :])
                    for line in done.stdout.splitlines()
                    if line.startswith("RANK ")
                ]
                if done.returncode != 0 or len(found) != ranks:
                    sys.exit(f"{strategy} x {ranks} failed:\n{done.stderr[-3000:]}")
                row = {
                    "strategy": strategy,
                    "ranks": ranks,
                    "peak_gib_per_rank": max(r["peak_gib"] for r in found),
                    "peak_gib_by_rank": [
                        r["peak_gib"] for r in sorted(found, key=lambda r: r["rank"])
                    ],
                    "rollout_s": max(r["rollout_s"] for r in found),
                    "update_s": max(r["update_s"] for r in found),
                }
                runs.append(row)
                print(json.dumps(row), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"params": params, "runs": runs}, indent=1) + "\n")
    print(f"{params:,} parameters\n")
    print("| strategy | ranks | peak GiB per rank (largest) | by rank | rollout s | update s |")
    print("|---|---:|---:|---|---:|---:|")
    for r in runs:
        by_rank = " / ".join(f"{peak:.2f}" for peak in r["peak_gib_by_rank"])
        print(
            f"| {r['strategy']} | {r['ranks']} | {r['peak_gib_per_rank']:.2f} | {by_rank} | "
            f"{r['rollout_s']:.1f} | {r['update_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
