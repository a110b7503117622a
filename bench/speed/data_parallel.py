"""Data-parallel training on this machine: 1 process vs N processes under torchrun.

Both runs train the warm-started tiny default on the same global batch (``--global-batch``
prompts per iteration, mini-batches of a quarter of it); with N processes each rank holds
1/N of the rows. Reports the median seconds per PPO iteration (rollout, update, total) over the
iterations after the first, for each of ``--repeats`` runs, and writes
``bench/results/data_parallel.json``.

Each run is ``ppo_core.training.loop.train`` (built-in defaults plus this bench's overrides) in
processes of its own, one per rank; rank 0 reports the trainer's own per-iteration
``perf/rollout_s``, ``perf/update_s`` and ``perf/iteration_s`` from ``TrainSummary.history``.

    .venv/bin/python -m bench.speed.data_parallel --model models/base [--procs 2] [--iterations 12]
    .venv/bin/python -m bench.speed.data_parallel --smoke   # a one-layer model, 2 iterations of 8 rows
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("rollout_s", "update_s", "iteration_s")


def free_port() -> int:
    """A loopback port nothing listens on now, for one torchrun launch."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(procs: int, args: argparse.Namespace, work: Path) -> dict[str, float]:
    """The medians over the iterations after the first of one run with ``procs`` processes."""
    per_rank = args.global_batch // procs
    overrides = [
        f"model.policy={args.model}",
        f"data.train_file={args.prompts}",
        f"train.output_dir={work / 'candidate'}",
        f"train.checkpoint_dir={work / 'ckpt'}",
        f"train.metrics_dir={work / 'metrics'}",
        "train.resume=false",
        f"train.iterations={args.iterations}",
        f"train.checkpoint_every={args.iterations}",
        f"ppo.rollout_batch_size={per_rank}",
        f"ppo.mini_batch_size={per_rank // 4}",
        f"ppo.micro_batch_size={per_rank // 4}",
        f"threads={args.threads}",
    ]
    child = ["-m", __spec__.name, "--child", json.dumps(overrides)]
    if procs == 1:
        command = [sys.executable, *child]
    else:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        command = [torchrun, "--nproc_per_node", str(procs), "--master-port", str(free_port())]
        command += child
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_DISABLE_PROGRESS_BARS="1")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    reported = [line for line in done.stdout.splitlines() if line.startswith("TIMES ")]
    if done.returncode or len(reported) != 1:
        sys.exit(f"{procs} process(es) failed:\n{done.stderr[-3000:]}")
    iterations = json.loads(reported[0].removeprefix("TIMES "))[1:]
    return {key: statistics.median(row[key] for row in iterations) for key in PHASES}


def child(overrides: list[str]) -> None:
    """One rank: train, then (rank 0) print each iteration's seconds as the trainer measured
    them, on one ``TIMES [...]`` line."""
    from ppo_core.config import load_config
    from ppo_core.parallel.process_group import is_main_process
    from ppo_core.training.loop import train

    summary = train(load_config(overrides=overrides))
    if is_main_process():
        times = [{key: row[f"perf/{key}"] for key in PHASES} for row in summary.history]
        print("TIMES " + json.dumps(times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "base"))
    parser.add_argument("--prompts", default=str(ROOT / "data" / "prepared" / "train.parquet"))
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "data_parallel.json"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    from bench import common

    parser.add_argument(
        "--smoke", action="store_true", help=f"{common.HELP} (the model: common.tiny_model)"
    )
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:  # 2 ranks of 4 rows, mini-batches of 1; the second iteration is timed
            args.procs, args.global_batch, args.iterations, args.repeats = 2, 8, 2, 1
            args.out = common.output_folder("data_parallel") / "data_parallel.json"
            args.model = str(common.tiny_model(Path(tmp) / "model"))
            args.prompts = str(common.prompt_files(Path(tmp) / "prompts")[0])
        results: dict[str, list[dict[str, float]]] = {"1": [], str(args.procs): []}
        for repeat in range(args.repeats):
            for procs in (1, args.procs):
                results[str(procs)].append(run(procs, args, Path(tmp) / f"{procs}-{repeat}"))
    summary = {
        procs: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for procs, runs in results.items()
    }
    print(f"{'processes':>9} {'rollout s':>10} {'update s':>9} {'iteration s':>12}")
    for procs, row in summary.items():
        print(
            f"{procs:>9} {row['rollout_s']:>10.3f} {row['update_s']:>9.3f} {row['iteration_s']:>12.3f}"
        )
    speedup = summary["1"]["iteration_s"] / summary[str(args.procs)]["iteration_s"]
    print(f"speed-up with {args.procs} processes: {speedup:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "settings": {k: str(v) for k, v in vars(args).items()},
                "runs": results,
                "median": summary,
                "speedup": speedup,
                "machine": common.machine(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
