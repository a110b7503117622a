"""Per-rank memory and time of PPO iterations: DDP against FSDP, 1 and 2 ranks (gloo, CPU).

A random-weight Llama-style model (the ``100M`` shape of ``bench/speed/memory_scaling.py``: hidden
768, 14 layers, vocabulary 512, 99.9M parameters) runs two PPO iterations of full fine-tuning
(AdamW) under ``torchrun --nproc_per_node R`` with ``parallel.strategy`` ``ddp`` or ``fsdp``:
global rollout batch 8 (8 / R per rank), mini-batch 8 / R per rank, micro-batch 4, 1 epoch, 16
new tokens, 1 thread per rank, a checkpoint after each iteration. Each rank reports:

- ``iteration_gib``: the peak resident set of the second iteration (rollout, update and its
  checkpoint), the high-water mark being reset after the first (``/proc/self/clear_refs``):
  the steady state of a run, whose model, gradients and optimizer state all exist;
- ``before_gib``: the resident set before any model is loaded (the interpreter and libraries),
  part of every figure;
- ``process_gib``: the peak of the whole process (loading and the final candidate included);
- the second iteration's ``perf/rollout_s``, ``perf/update_s`` and, for FSDP, ``perf/gather_s``
  (gathering the policy whole for sampling, part of the rollout).

glibc keeps freed heap memory resident, so that the resident set would show the largest earlier
moment rather than the memory in use; the ranks run with ``MALLOC_MMAP_THRESHOLD_=65536``, so
that every tensor of 64 KiB or more is its own mapping, returned when it is freed.

On GPUs (``--device cuda --precision bf16``, NCCL, one GPU per rank) each rank also reports
``device_gib``, ``torch.cuda.max_memory_allocated`` over the second iteration.

Writes ``bench/results/sharding.json`` (``sharding_cuda.json`` on GPUs).

    .venv/bin/python -m bench.speed.sharding [--ranks 1 2] [--strategies ddp fsdp]
    .venv/bin/python -m bench.speed.sharding --smoke   # FSDP over 2 ranks of a 2-layer model of width 64
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

ROOT = Path(__file__).resolve().parents[2]
SHAPE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 14}
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
"""``--smoke``: this shape, FSDP over 2 ranks only (the launch that uses the most of the bench:
gathering, sharded checkpoints, both collectives)."""


def varied_reward(prompts: list, responses: list[str]) -> torch.Tensor:
    """A score that varies over random text, so that the update is not zero."""
    return torch.tensor([(sum(map(ord, r)) % 11) / 10.0 for r in responses])


def resident_gib(field: str = "VmRSS") -> float:
    """This process's resident set (``VmRSS``) or its high-water mark (``VmHWM``), in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 2**30
    raise RuntimeError(f"no {field} in /proc/self/status")


class PeakOfSecondIteration:
    """Wraps two of the trainer's steps on every rank: resets the high-water mark when iteration
    2 starts and reads it when the final candidate is about to be gathered, so that the figure
    covers iteration 2 and its checkpoint (Linux: writing 5 to ``clear_refs`` resets
    ``VmHWM``)."""

    def __init__(self, trainer) -> None:
        self.iteration_gib = self.device_gib = float("nan")
        self.run_iteration, self.full_model_state = trainer.run_iteration, trainer.full_model_state
        trainer.run_iteration, trainer.full_model_state = self.iterate, self.gather

    def iterate(self, config, runtime, inputs, models, state, *engine):
        if state.iteration == 1:
            Path("/proc/self/clear_refs").write_text("5")
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
        return self.run_iteration(config, runtime, inputs, models, state, *engine)

    def gather(self, models):
        self.iteration_gib = resident_gib("VmHWM")
        if torch.cuda.is_available():
            self.device_gib = torch.cuda.max_memory_allocated() / 2**30
        return self.full_model_state(models)


GLOBAL_BATCH = 8
"""Rollout rows of an iteration over all ranks (each rank's share rounded up)."""


def free_port() -> int:
    """A loopback port nothing listens on now, for one torchrun launch."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_file(work: Path, strategy: str, ranks: int, rank: str) -> Path:
    """Where one rank of a launch leaves its numbers (``rank="*"``: a glob of all of them)."""
    return work / f"rank-{strategy}-{ranks}-{rank}.json"


def rank_main(args: argparse.Namespace) -> None:
    """One rank of a torchrun launch: two iterations, then this rank's numbers in
    :func:`rank_file`."""
    before_gib = resident_gib()
    from ppo_core.config import load_config
    from ppo_core.training import loop as trainer

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    work = Path(args.work)
    out = work / f"out-{args.strategy}-{ranks}"  # a run of its own: nothing to resume from
    peak = PeakOfSecondIteration(trainer)
    per_rank = -(-GLOBAL_BATCH // ranks)  # at least GLOBAL_BATCH rows in all, on any count
    summary = trainer.train(
        load_config(
            overrides=[
                f"model.policy={work / 'model'}",
                f"data.train_file={work / 'train.jsonl'}",
                f"train.output_dir={out / 'candidate'}",
                f"train.checkpoint_dir={out / 'checkpoints'}",
                "train.resume=false",
                "train.iterations=2",
                "train.checkpoint_every=1",
                f"ppo.rollout_batch_size={per_rank}",
                f"ppo.mini_batch_size={per_rank}",
                f"ppo.micro_batch_size={min(4, per_rank)}",
                "ppo.epochs=1",
                "generation.max_new_tokens=16",
                "threads=1",
                f"device={args.device}",
                f"precision={args.precision}",
                "model.reward=bench.speed.sharding:varied_reward",
                f"parallel.strategy={args.strategy}",
            ]
        )
    )
    metrics = summary.history[1]
    # read before the collectives are timed: their buffers are the size of the whole model
    process_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    update_comm_s = (
        update_collectives_seconds(work / "model", ranks, args.strategy, args.device)
        if ranks > 1
        else 0.0
    )
    # a file per rank: the ranks share torchrun's stdout, where one rank's line can land
    # inside another's (print writes the text and its newline apart)
    rank = int(os.environ.get("RANK", "0"))
    rank_file(work, args.strategy, ranks, str(rank)).write_text(
        json.dumps(
            {
                "rank": rank,
                "iteration_gib": peak.iteration_gib,
                "device_gib": peak.device_gib,
                "before_gib": before_gib,
                "process_gib": process_gib,
                "rollout_s": metrics["perf/rollout_s"],
                "gather_s": metrics.get("perf/gather_s", 0.0),
                "update_s": metrics["perf/update_s"],
                "update_comm_s": update_comm_s,
            }
        )
    )


def update_collectives_seconds(model: Path, ranks: int, strategy: str, device: str) -> float:
    """The update's communication, timed alone. This bench's update is one optimizer step of
    one micro-batch per rank. Under ``fsdp`` the parameters are all-gathered for its forward
    pass and again for its backward pass (they are resharded after the forward pass) and the
    gradients are reduce-scattered; under ``ddp`` the gradients are all-reduced once. Each
    collective covers every parameter (fp32, as the shards and gradients are); median of 3.
    Timed without the overlap with compute that FSDP's prefetching and DDP's buckets get, so
    it is an upper bound of what the update waits for."""
    import math
    import statistics
    import time

    import torch.distributed as dist
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as weights:
        numel = sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())  # noqa: SIM118
    numel = -(-numel // ranks) * ranks
    whole = torch.zeros(numel, device=device)
    shard = torch.zeros(numel // ranks, device=device)

    def timed(collective) -> float:
        times = []
        for _ in range(3):
            dist.barrier()
            started = time.perf_counter()
            collective()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    if strategy == "ddp":
        return timed(lambda: dist.all_reduce(whole))
    gather = timed(lambda: dist.all_gather_into_tensor(whole, shard))
    scatter = timed(lambda: dist.reduce_scatter_tensor(shard, whole))
    return 2 * gather + scatter


def build(work: Path, shape: dict[str, int]) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ppo_core.base_sources.review_grammar import default_prompts, generate_review_corpus
    from ppo_core.base_sources.tiny_default import train_tokenizer

    tokenizer = train_tokenizer(generate_review_corpus(500, seed=0), vocab_size=512)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        num_attention_heads=shape["hidden_size"] // 64,
        num_key_value_heads=shape["hidden_size"] // 64,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(work / "model", safe_serialization=True)
    tokenizer.save_pretrained(work / "model")
    prompts = default_prompts(64, seed=0)
    (work / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return sum(p.numel() for p in model.parameters())


def launch(work: Path, strategy: str, ranks: int, args: argparse.Namespace, env: dict) -> dict:
    """One torchrun launch of ``ranks`` processes under ``strategy``: its row of the table,
    memory by rank and the slowest rank's seconds."""
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run(
        [str(torchrun), "--nproc_per_node", str(ranks), "--master-port", str(free_port()),
         "-m", __spec__.name, "--rank-of", str(work), "--strategy", strategy,
         "--device", args.device, "--precision", args.precision],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    found = [
        json.loads(path.read_text())
        for path in work.glob(rank_file(work, strategy, ranks, "*").name)
    ]
    if done.returncode != 0 or len(found) != ranks:
        sys.exit(f"{strategy} x {ranks} failed:\n{done.stderr[-3000:]}")
    found.sort(key=lambda r: r["rank"])
    return {
        "strategy": strategy,
        "ranks": ranks,
        **{
            key: [r[key] for r in found]
            for key in ("iteration_gib", "device_gib", "before_gib", "process_gib")
        },
        **{
            key: max(r[key] for r in found)
            for key in ("rollout_s", "gather_s", "update_s", "update_comm_s")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out", type=Path, help="default: bench/results/sharding[_cuda].json")
    parser.add_argument("--rank-of", dest="work", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    from bench import common

    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    if args.work:
        rank_main(args)
        return
    if args.smoke:
        args.ranks, args.strategies = [2], ["fsdp"]
        args.out = common.output_folder("sharding") / "sharding.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    runs = []
    with tempfile.TemporaryDirectory(prefix="sharding-") as tmp:
        work = Path(tmp)
        params = build(work, SMOKE_SHAPE if args.smoke else SHAPE)
        for ranks in args.ranks:
            for strategy in args.strategies:
                if strategy == "fsdp" and ranks == 1:
                    continue  # nothing to shard over (refused by key)
                row = launch(work, strategy, ranks, args, env)
                runs.append(row)
                print(json.dumps(row), file=sys.stderr)
    suffix = "_cuda" if args.device == "cuda" else ""
    args.out = args.out or ROOT / "bench" / "results" / f"sharding{suffix}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"params": params, "runs": runs, "machine": common.machine()}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{params:,} parameters\n")
    print(
        "| strategy | ranks | iteration peak GiB by rank | before loading | whole process | "
        "rollout s | of which gather s | update s | its collectives s | GPU GiB by rank |"
    )
    print("|---|---:|---|---|---|---:|---:|---:|---:|---|")

    def by_rank(values: list[float]) -> str:
        return " / ".join(f"{value:.2f}" for value in values)

    for r in runs:
        print(
            f"| {r['strategy']} | {r['ranks']} | {by_rank(r['iteration_gib'])} | "
            f"{by_rank(r['before_gib'])} | {by_rank(r['process_gib'])} | {r['rollout_s']:.1f} | "
            f"{r['gather_s']:.2f} | {r['update_s']:.1f} | {r['update_comm_s']:.2f} | "
            f"{by_rank(r['device_gib'])} |"
        )


if __name__ == "__main__":
    main()
