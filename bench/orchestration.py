"""Orchestration overhead: the default pipeline through Prefect + DVC vs the same stages called
directly.

Each run starts from a fresh clone of the current commit (``git clone`` of this repository into
a temporary folder, no outputs yet) and times, from the same empty state:

- ``direct``: ``ppo prepare``, ``ppo base``, ``ppo validate``, ``ppo train``, ``ppo evaluate``,
  ``ppo promote``, each with ``-c params.yaml``;
- ``flow``: ``python -m flows.pipeline run`` (a temporary local Prefect server; each stage as
  ``dvc repro --single-item <stage>``).

Both use this repository's ``.venv``. The sides alternate, ``--repeats`` times each; writes
``bench/results/orchestration.json``.

    .venv/bin/python bench/orchestration.py [--repeats 2]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("prepare", "base", "validate", "train", "evaluate", "promote")


def fresh_clone(where: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
    return where


def timed(commands: list[list[str]], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    for command in commands:
        subprocess.run(command, cwd=cwd, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "orchestration.json"
    )
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    runs: dict[str, list[float]] = {"direct": [], "flow": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for side in ("direct", "flow"):
                project = fresh_clone(Path(tmp) / f"{side}-{repeat}")
                commands = (
                    [[str(bin_dir / "ppo"), stage, "-c", "params.yaml"] for stage in STAGES]
                    if side == "direct"
                    else [[sys.executable, "-m", "flows.pipeline", "run"]]
                )
                runs[side].append(timed(commands, project, env))
                print(f"repeat {repeat} {side}: {runs[side][-1]:.1f} s", flush=True)
    direct, flow = statistics.median(runs["direct"]), statistics.median(runs["flow"])
    overhead = flow - direct
    print(
        f"direct {direct:.1f} s, flow {flow:.1f} s: overhead {overhead:.1f} s "
        f"({overhead / flow:.1%} of the flow's total)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "runs": runs,
                "median": {"direct": direct, "flow": flow},
                "overhead_s": overhead,
                "overhead_share": overhead / flow,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
