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

On a shared machine the stages' own time varies by tens of seconds from run to run, more than
the orchestration costs, so the difference of the totals says little from a few runs. The bench
also records each stage's seconds (direct: the command; flow: from DVC's ``Running stage`` line
to the task's end, from the flow's log), the flow's time outside its stage tasks (server,
imports, task bookkeeping, DVC's work before each stage, the experiment record), and what DVC
adds inside a stage's time, after its command (:func:`dvc_seconds_a_stage`); their sum
estimates the overhead without the stages' noise.

    .venv/bin/python -m bench.speed.orchestration [--repeats 2] [--flows flow flow_on_a_server]
    .venv/bin/python -m bench.speed.orchestration --smoke

``--smoke`` runs ``direct`` and ``flow`` once each on the pipeline made as small as it goes
(:data:`SMOKE_PARAMS`, written into the clone's ``params.yaml``) and DVC's share of one stage
once; it still takes a minute or more, most of it process and server start-up.
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

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("prepare", "base", "validate", "train", "evaluate", "promote")


SMOKE_PARAMS = {
    "base": {"tiny_steps": 2},
    "train": {"iterations": 1},
    "ppo": {"rollout_batch_size": 8, "mini_batch_size": 8, "micro_batch_size": 8, "epochs": 1},
    "generation": {"max_new_tokens": 4},
    "eval": {"num_prompts": 4, "samples_per_prompt": 1, "num_examples": 2},
}
"""What ``--smoke`` changes in the clone's ``params.yaml``: the least work each stage can do."""


def fresh_clone(where: Path, params: dict[str, dict] | None = None) -> Path:
    """A clone of this repository's current commit in ``where``, with ``params`` (section ->
    key -> value) set in its ``params.yaml``."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
    if params:
        import yaml

        values = yaml.safe_load((where / "params.yaml").read_text())
        for section, keys in params.items():
            values[section].update(keys)
        (where / "params.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    return where


def timed(
    commands: list[list[str]], cwd: Path, env: dict[str, str]
) -> tuple[float, list[float], str]:
    """Seconds the commands take in a row, the seconds of each, and their output (stdout and
    stderr)."""
    start = time.perf_counter()
    output = ""
    each = []
    for command in commands:
        began = time.perf_counter()
        done = subprocess.run(command, cwd=cwd, env=env, check=True, capture_output=True, text=True)
        each.append(time.perf_counter() - began)
        output += done.stdout + done.stderr
    return time.perf_counter() - start, each, output


def dvc_seconds_a_stage(project: Path, env: dict[str, str], repeats: int = 5) -> dict[str, float]:
    """What DVC adds to one stage as the flow runs it: ``ppo promote`` on its own, against
    ``dvc repro --single-item --force promote`` sent to a :class:`flows.orchestration.dvc_session.DvcSession`
    that has imported DVC and run one command already, as the flow's has by its second stage
    (alternating, median of ``repeats`` each). Each ``--force`` run writes a new production
    version: run it in a project of its own.

    Returns the medians of both sides, ``dvc_adds`` (their difference), and its two parts:
    ``before_the_stage`` (to DVC's ``Running stage`` line, which the flow's log shows outside
    the stage's time) and ``after_the_command`` (hashing and caching the outputs, the lock;
    inside it)."""
    from flows.orchestration.dvc_session import DvcSession
    from flows.orchestration.relay import StageRelay

    bin_dir = Path(sys.executable).parent
    sides: dict[str, list[float]] = {"command": [], "dvc": [], "before_the_stage": []}
    forced = ["repro", "--single-item", "--force", "promote"]
    with DvcSession(str(project), env) as session:

        def forced_run() -> tuple[float, float]:
            """Seconds to the ``Running stage`` line, and in all."""
            began = time.perf_counter()
            running: list[float] = []

            def log(level: int, text: str) -> None:
                if not running and "Running stage" in text:
                    running.append(time.perf_counter() - began)

            code = session.run(forced, StageRelay("promote", log, str(project)))
            if code != 0 or not running:
                raise RuntimeError(f"`dvc {' '.join(forced)}` failed with exit code {code}")
            return running[0], time.perf_counter() - began

        forced_run()  # DVC imported and warm, as after the flow's first stage
        for _ in range(repeats):
            sides["command"].append(
                timed([[str(bin_dir / "ppo"), "promote", "-c", "params.yaml"]], project, env)[0]
            )
            before, total = forced_run()
            sides["before_the_stage"].append(before)
            sides["dvc"].append(total)
    median = {side: statistics.median(seconds) for side, seconds in sides.items()}
    adds = median["dvc"] - median["command"]
    return median | {"dvc_adds": adds, "after_the_command": adds - median["before_the_stage"]}


# Log lines of the flow that mark the phases of a run (Prefect's "HH:MM:SS.mmm | LEVEL | ...").
_STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) \|")
MARKS = {
    "flow_started": "Beginning flow run",
    "stages_done": "outputs: {",
    "experiment_saved": "recorded as the DVC experiment",
    "flow_ended": "Finished in state",
}


def _stamped_lines(output: str, started: float) -> list[tuple[float, str]]:
    """The log lines of the flow with their time, in seconds since ``started``."""
    day = time.mktime((*time.localtime(started)[:3], 0, 0, 0, 0, 0, -1))
    lines = []
    for line in output.splitlines():
        stamp = _STAMP.match(line)
        if stamp:
            seconds = day + int(stamp[1]) * 3600 + int(stamp[2]) * 60 + float(stamp[3])
            lines.append((seconds - started, line))
    return lines


def phases(output: str, started: float, total: float) -> dict[str, float]:
    """Where the flow's wall time went, from its log's timestamps: server start-up and imports
    before the flow begins, the stages, the DVC experiment record, and the rest (the flow's end
    and the temporary server's shutdown)."""
    at: dict[str, float] = {}
    for seconds, line in _stamped_lines(output, started):
        for name, text in MARKS.items():
            if text in line and name not in at:
                at[name] = seconds
    if len(at) < len(MARKS):
        return {}
    return {
        "before_the_flow": at["flow_started"],
        "stages": at["stages_done"] - at["flow_started"],
        "experiment_record": at["experiment_saved"] - at["stages_done"],
        "after_the_record": total - at["experiment_saved"],
    }


def stage_seconds(output: str, started: float) -> dict[str, float]:
    """Each stage's task in the flow, from DVC's ``Running stage`` line to the task's end."""
    begun: dict[str, float] = {}
    took: dict[str, float] = {}
    for seconds, line in _stamped_lines(output, started):
        for stage in STAGES:
            if f"Running stage '{stage}'" in line:
                begun[stage] = seconds
            elif f"Task run '{stage}' - Finished" in line and stage in begun:
                took[stage] = seconds - begun[stage]
    return took


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
    parser.add_argument(
        "--flows",
        nargs="+",
        choices=SIDES[1:],
        default=list(SIDES[1:]),
        help="the flow sides to run against direct",
    )
    from bench import common

    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    params, dvc_repeats = None, 5
    if args.smoke:
        args.repeats, args.flows, params, dvc_repeats = 1, ["flow"], SMOKE_PARAMS, 1
        args.out = common.output_folder("orchestration") / "orchestration.json"
    measured = measure(("direct", *args.flows), args.repeats, params, dvc_repeats)
    flows = args.flows
    stages, breakdown = measured["stage_s"], measured["flow_phases"]
    unread = [
        side
        for side in flows
        if not all(breakdown[side]) or any(len(found) < len(STAGES) for found in stages[side])
    ]
    if args.smoke and unread:  # a full run keeps what it found; a smoke run must not pass on it
        sys.exit(f"the phases or stage times of {unread} were not found in the flow's log")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {**measured, **overhead_of(measured, flows), "machine": common.machine()}
    args.out.write_text(json.dumps(result, indent=1))


def measure(sides: tuple[str, ...], repeats: int, params, dvc_repeats: int) -> dict:
    """Each side's whole runs in fresh clones, ``repeats`` times in turn: the seconds of each
    run, of each stage, outside the stages and by phase of the flow, and DVC's own time a
    stage."""
    flows = sides[1:]
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PREFECT_API_URL", None)
    runs: dict[str, list[float]] = {side: [] for side in sides}
    stages: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    outside: dict[str, list[float]] = {side: [] for side in flows}
    breakdown: dict[str, list[dict[str, float]]] = {side: [] for side in flows}
    with tempfile.TemporaryDirectory() as tmp:
        server, api = running_server(Path(tmp), env) if "flow_on_a_server" in sides else (None, "")
        try:
            for repeat in range(repeats):
                for side in sides:
                    project = fresh_clone(Path(tmp) / f"{side}-{repeat}", params)
                    commands = (
                        [[str(bin_dir / "ppo"), stage, "-c", "params.yaml"] for stage in STAGES]
                        if side == "direct"
                        else [[sys.executable, "-m", "flows.pipeline", "run"]]
                    )
                    side_env = env | ({"PREFECT_API_URL": api} if side.endswith("server") else {})
                    started = time.time()
                    seconds, each, output = timed(commands, project, side_env)
                    runs[side].append(seconds)
                    stages[side].append(
                        dict(zip(STAGES, each, strict=True))
                        if side == "direct"
                        else stage_seconds(output, started)
                    )
                    report = {k: round(v, 1) for k, v in stages[side][-1].items()}
                    print(f"repeat {repeat} {side}: {seconds:.1f} s; {report}", flush=True)
                    if side != "direct":
                        outside[side].append(seconds - sum(stages[side][-1].values()))
                        breakdown[side].append(phases(output, started, seconds))
                        parts = {k: round(v, 1) for k, v in breakdown[side][-1].items()}
                        print(f"  outside the stages {outside[side][-1]:.1f} s; {parts}")
            dvc_stage = dvc_seconds_a_stage(Path(tmp) / "direct-0", env, dvc_repeats)
        finally:
            if server is not None:
                server.kill()
    print(f"DVC a stage: {json.dumps({k: round(v, 2) for k, v in dvc_stage.items()})}")
    return {
        "runs": runs,
        "stage_s": stages,
        "outside_the_stages_s": outside,
        "dvc_a_stage_s": dvc_stage,
        "flow_phases": breakdown,
    }


def overhead_of(measured: dict, flows: list[str]) -> dict:
    """Each flow side's median against direct's, and the noise-free estimate of the overhead,
    printed and returned."""
    runs, outside = measured["runs"], measured["outside_the_stages_s"]
    median = {side: statistics.median(values) for side, values in runs.items()}
    overhead = {side: median[side] - median["direct"] for side in flows}
    # Noise-free estimate: the flow's time outside its stage tasks (DVC's work before each
    # stage's `Running stage` line is in it), plus what DVC adds inside each of them, after the
    # stage's command; the stages' own compute, which varies from run to run, is not in it.
    inside = max(measured["dvc_a_stage_s"]["after_the_command"], 0.0)
    estimate = {side: statistics.median(outside[side]) + len(STAGES) * inside for side in flows}
    # The share of the same run's work (its total less the overhead), so that the stages'
    # noise between the sides does not enter it.
    share = {side: estimate[side] / (median[side] - estimate[side]) for side in estimate}
    for side in flows:
        print(
            f"{side}: {median[side]:.1f} s against {median['direct']:.1f} s direct (difference "
            f"{overhead[side]:+.1f} s); outside the stages {statistics.median(outside[side]):.1f}"
            f" s; estimated overhead {estimate[side]:.1f} s, {share[side]:.1%} on top of the "
            "run's own work"
        )
    return {
        "median": median,
        "difference_s": overhead,
        "estimated_overhead_s": estimate,
        "estimated_overhead_share": share,
    }


if __name__ == "__main__":
    main()
