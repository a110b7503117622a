"""Data-parallel training on this machine: 1 process vs N processes under torchrun.

Both runs train the warm-started tiny default on the same global batch (``--global-batch``
prompts per iteration, mini-batches of a quarter of it); with N processes each rank holds
1/N of the rows. Reports the median seconds per PPO iteration (rollout, update, total) over the
iterations after the first, for each of ``--repeats`` runs, and writes
``bench/results/data_parallel.json``.

    .venv/bin/python bench/data_parallel.py --model models/base [--procs 2] [--iterations 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(procs: int, args: argparse.Namespace, work: Path) -> dict[str, float]:
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
    bin_dir = Path(sys.executable).parent
    if procs == 1:
        command = [str(bin_dir / "ppo"), "train", "--quiet", *overrides]
    else:
        command = [
            str(bin_dir / "torchrun"),
            "--nproc_per_node",
            str(procs),
            "-m",
            "flows.cli",
            "train",
            "--quiet",
            *overrides,
        ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    rows = {}
    for key in ("rollout_s", "update_s", "iteration_s"):
        series = (
            (work / "metrics" / "plots" / "metrics" / "perf" / f"{key}.tsv")
            .read_text()
            .split("\n")[2:]
        )
        values = [float(line.split("\t")[1]) for line in series if line.strip()]
        rows[key] = statistics.median(values)
    return rows


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
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"1": [], str(args.procs): []}
    with tempfile.TemporaryDirectory() as tmp:
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
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
