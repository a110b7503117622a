"""Orchestration overhead: the default pipeline through Prefect + DVC vs the same stages called
directly.

Each run starts from a fresh clone of the current commit (``git clone`` of this repository into
a temporary folder, no outputs yet) and times, from the same empty state:

- ``direct``: ``ppo prepare``, ``ppo base``, ``ppo validate``, ``ppo train``, ``ppo evaluate``,
  ``ppo promote``, each with ``-c params.yaml``;
- ``flow``: ``python -m flows.pipeline run`` (a temporary local Prefect server; each stage as
  ``dvc repro --single-item <stage>``), as ``make run`` does;
- ``flow_on_a_server``: the same with ``PREFECT_API_URL`` naming a Prefect server that is already
  up, as a deployment's runs find one.

Both use this repository's ``.venv``. The sides alternate, ``--repeats`` times each; writes
``bench/results/orchestration.json``.

    .venv/bin/python bench/orchestration.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def timed(commands: list[list[str]], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    """Seconds the commands take in a row, and their output (stdout and stderr)."""
    start = time.perf_counter()
    output = ""
    for command in commands:
        done = subprocess.run(command, cwd=cwd, env=env, check=True, capture_output=True, text=True)
        output += done.stdout + done.stderr
    return time.perf_counter() - start, output


# Log lines of the flow that mark the phases of a run (Prefect's "HH:MM:SS.mmm | LEVEL | ...").
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) \|")
MARKS = {
    "flow_started": "Beginning flow run",
    "stages_done": "outputs: {",
    "experiment_saved": "recorded as the DVC experiment",
    "flow_ended": "Finished in state",
}


def phases(output: str, started: float, total: float) -> dict[str, float]:
    """Where the flow's wall time went, from its log's timestamps: server start-up and imports
    before the flow begins, the stages, the DVC experiment record, and the rest (the flow's end
    and the temporary server's shutdown)."""
    at: dict[str, float] = {}
    day = time.mktime((*time.localtime(started)[:3], 0, 0, 0, 0, 0, -1))
    for line in output.splitlines():
        stamp = _STAMP.match(line)
        if not stamp:
            continue
        seconds = day + int(stamp[1]) * 3600 + int(stamp[2]) * 60 + float(stamp[3])
        for name, text in MARKS.items():
            if text in line and name not in at:
                at[name] = seconds - started
    if len(at) < len(MARKS):
        return {}
    return {
        "before_the_flow": at["flow_started"],
        "stages": at["stages_done"] - at["flow_started"],
        "experiment_record": at["experiment_saved"] - at["stages_done"],
        "after_the_record": total - at["experiment_saved"],
    }


def running_server(tmp: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """A Prefect server on a free loopback port, as a deployment's runs find one; up."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "server", "start", "--port", str(port)],
        env=env | {"PREFECT_HOME": str(tmp / "prefect-home")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2):
                return server, api
        except OSError:
            time.sleep(1)
    server.kill()
    raise TimeoutError("the Prefect server did not start in 180 s")


SIDES = ("direct", "flow", "flow_on_a_server")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "orchestration.json"
    )
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PREFECT_API_URL", None)
    runs: dict[str, list[float]] = {side: [] for side in SIDES}
    breakdown: dict[str, list[dict[str, float]]] = {"flow": [], "flow_on_a_server": []}
    with tempfile.TemporaryDirectory() as tmp:
        server, api = running_server(Path(tmp), env)
        try:
            for repeat in range(args.repeats):
                for side in SIDES:
                    project = fresh_clone(Path(tmp) / f"{side}-{repeat}")
                    commands = (
                        [[str(bin_dir / "ppo"), stage, "-c", "params.yaml"] for stage in STAGES]
                        if side == "direct"
                        else [[sys.executable, "-m", "flows.pipeline", "run"]]
                    )
                    side_env = env | ({"PREFECT_API_URL": api} if side.endswith("server") else {})
                    started = time.time()
                    seconds, output = timed(commands, project, side_env)
                    runs[side].append(seconds)
                    print(f"repeat {repeat} {side}: {seconds:.1f} s", flush=True)
                    if side != "direct":
                        breakdown[side].append(phases(output, started, seconds))
                        print(
                            "  "
                            + json.dumps({k: round(v, 1) for k, v in breakdown[side][-1].items()})
                        )
        finally:
            server.kill()
    median = {side: statistics.median(runs[side]) for side in SIDES}
    overhead = {side: median[side] - median["direct"] for side in SIDES[1:]}
    for side in SIDES[1:]:
        print(
            f"{side}: {median[side]:.1f} s against {median['direct']:.1f} s direct: overhead "
            f"{overhead[side]:.1f} s ({overhead[side] / median[side]:.1%} of its total)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "runs": runs,
                "median": median,
                "overhead_s": overhead,
                "overhead_share": {side: overhead[side] / median[side] for side in overhead},
                "flow_phases": breakdown,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
