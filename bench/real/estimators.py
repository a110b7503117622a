"""The advantage estimators side by side on the default task, at an equal rollout budget.

For each estimator and seed: ``ppo train`` from the default pipeline's ``models/base`` on its
prepared prompts (``params.yaml`` with only the estimator's keys and the seed changed), then
``ppo evaluate`` of the result against ``models/base`` on the held-out prompts. Every run samples
the same number of responses (``ppo.rollout_batch_size`` x ``train.iterations``); the grouped
estimators draw a quarter as many prompts, each 4 times. Reported per run and as the mean over
seeds: held-out score, positive rate, KL to the reference, distinct-2, the training's wall time
and its peak resident memory (the ``ppo train`` process, from ``wait4``).

Run it in a checkout where ``make run`` has built ``models/base`` and ``data/prepared``; it
writes only under ``--workdir`` and to ``bench/results/estimators.json``.

    .venv/bin/python -m bench.real.estimators [--seeds 0 1 2] [--jobs 2] [--workdir /tmp/estimators]
    .venv/bin/python -m bench.real.estimators --smoke   # no `make run` needed: see SMOKE

``--smoke`` checks that every estimator's settings still make a valid config, then runs one
estimator (``grpo``: critic-free, grouped samples) end to end, seed 0, on a one-layer model
built on the spot, with the sizes of :data:`SMOKE`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMIT = subprocess.run(
    ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
).stdout.strip()
"""The code measured; a finished run of the same commit is not run again."""

SETTINGS: dict[str, list[str]] = {
    "gae": [],
    "grpo": ["ppo.advantage_estimator=grpo", "model.critic=none", "ppo.samples_per_prompt=4"],
    "dr_grpo": [
        "ppo.advantage_estimator=dr_grpo",
        "model.critic=none",
        "ppo.samples_per_prompt=4",
    ],
    "rloo": ["ppo.advantage_estimator=rloo", "model.critic=none", "ppo.samples_per_prompt=4"],
    "reinforce_pp": ["ppo.advantage_estimator=reinforce_pp", "model.critic=none"],
}
"""What each estimator changes in ``params.yaml``; everything else is the default run's."""

SMOKE = [
    "train.iterations=1",
    "ppo.rollout_batch_size=8",
    "ppo.mini_batch_size=8",
    "ppo.micro_batch_size=8",
    "ppo.epochs=1",
    "generation.max_new_tokens=4",
    "eval.num_prompts=4",
    "eval.samples_per_prompt=1",
    "eval.num_examples=2",
]
"""What ``--smoke`` sets besides the model and prompt files: the smallest run of each stage."""

REPORTED = {
    "score": "candidate/score",
    "positive_rate": "candidate/positive_rate",
    "kl": "candidate/kl_to_reference",
    "distinct_2": "candidate/distinct_2",
    "eos_rate": "candidate/eos_rate",
}


def run_measured(command: list[str], log: Path) -> tuple[float, float]:
    """Run ``command`` (output to ``log``); its wall seconds and peak resident MiB."""
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}); see {log}")
    return time.perf_counter() - started, usage.ru_maxrss / 1024  # Linux: kilobytes


def one_run(estimator: str, seed: int, workdir: Path, extra: tuple[str, ...] = ()) -> dict:
    """Train and evaluate one estimator at one seed (``extra``: more overrides, last)."""
    folder = workdir / f"{estimator}-seed{seed}"
    done = folder / "row.json"
    if done.is_file():  # finished by an earlier, interrupted invocation of the same commit
        row = json.loads(done.read_text())
        if row.get("commit") == COMMIT:
            return row
    folder.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"seed={seed}",
        f"train.output_dir={folder / 'candidate'}",
        f"train.checkpoint_dir={folder / 'checkpoints'}",
        f"train.metrics_dir={folder / 'metrics'}",
        f"eval.output_dir={folder / 'eval'}",
        "eval.baseline=models/base",
        "train.resume=false",
        *SETTINGS[estimator],
        *extra,
    ]
    cli = [sys.executable, "-m", "flows.cli"]
    seconds, peak_mib = run_measured(
        [*cli, "train", "-c", "params.yaml", *overrides], folder / "train.log"
    )
    run_measured([*cli, "evaluate", "-c", "params.yaml", *overrides], folder / "evaluate.log")
    metrics = json.loads((folder / "eval" / "metrics.json").read_text())
    row = {name: metrics[key] for name, key in REPORTED.items()}
    row.update(estimator=estimator, seed=seed, train_s=seconds, peak_mib=peak_mib, commit=COMMIT)
    done.write_text(json.dumps(row))
    print(json.dumps(row), flush=True)
    return row


def check_settings() -> None:
    """Every estimator's settings, on ``params.yaml``, make a valid config (no model needed)."""
    from ppo_core.config import load_config

    for estimator, settings in SETTINGS.items():
        load_config(ROOT / "params.yaml", settings)
        print(f"{estimator}: its settings make a valid config")


def summarise(rows: list[dict]) -> dict[str, dict[str, float]]:
    means = {}
    for estimator in SETTINGS:
        mine = [r for r in rows if r["estimator"] == estimator]
        if mine:
            means[estimator] = {
                key: statistics.fmean(r[key] for r in mine)
                for key in (*REPORTED, "train_s", "peak_mib")
            }
    return means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--estimators", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/estimators"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "estimators.json")
    from bench import common

    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="estimators-") as tmp:
        extra: tuple[str, ...] = ()
        if args.smoke:
            check_settings()
            args.estimators, args.seeds, args.jobs = ["grpo"], [0], 1
            args.workdir = Path(tmp) / "runs"
            args.out = common.output_folder("estimators") / "estimators.json"
            model = common.tiny_model(Path(tmp) / "model")
            train_file, eval_file = common.prompt_files(Path(tmp) / "prompts")
            extra = (
                f"model.policy={model}",
                f"eval.baseline={model}",
                f"data.train_file={train_file}",
                f"data.eval_file={eval_file}",
                *SMOKE,
            )
        else:
            for needed in ("models/base", "data/prepared/train.parquet"):
                if not (ROOT / needed).exists():
                    sys.exit(f"{needed} is missing: run `make run` in this checkout first")
        runs = [(e, s) for e in args.estimators for s in args.seeds]
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(lambda run: one_run(*run, args.workdir, extra), runs))
    result = {
        "settings": SETTINGS,
        "runs": rows,
        "means": summarise(rows),
        "machine": common.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| estimator | score | positive | KL | distinct-2 | EOS | train s | peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for estimator, m in result["means"].items():
        print(
            f"| {estimator} | {m['score']:.3f} | {m['positive_rate']:.1%} | {m['kl']:.2f} | "
            f"{m['distinct_2']:.3f} | {m['eos_rate']:.1%} | {m['train_s']:.0f} | "
            f"{m['peak_mib']:.0f} |"
        )


if __name__ == "__main__":
    main()
