"""Every benchmark in ``bench/`` still runs on today's code: its ``--smoke`` mode, as a subprocess
with the project's Python.

The benchmarks are found by glob, so that one added tomorrow is tested the day it is added:
every ``bench/<group>/*.py`` and ``*.sh`` but helpers (``bench/common.py``, names starting with
``_``, which a benchmark imports or runs and which are tested through it), the packages'
``__init__.py`` and environment builders (``setup_*``); a Python benchmark runs as a module
(``python -m bench.<group>.<name>``) from the repository's root. A benchmark without a
``--smoke`` mode fails here, saying so.

A smoke run takes the smallest sizes and one repeat, and writes its outputs to a new temporary
folder (``bench/common.py``); here ``$TMPDIR`` is the test's own folder. Each run must exit 0,
print no traceback, leave ``bench/results/`` and the plots in ``docs/`` as they were, and write a
JSON result holding at least one finite, non-integer number: something it measured, and the
machine it was measured on (a ``machine`` block: ``bench/common.py``'s ``machine()``). No test
asserts what the numbers are.

Shell benchmarks (``bench/gpu/gpu.sh``) run their smoke with ``--device cpu`` where torch sees no
CUDA device. ``bench/peers/ppo_vs_trl.py`` is run twice: this project's sides, and TRL's side, which
needs ``bench/.trl-venv`` (``bash bench/peers/setup_trl.sh``): without it that case is skipped, except
under ``PPO_SOAK=1`` (``make soak``), where its absence fails; ``bench/peers/grpo_vs_trl.py``
likewise (TRL's GRPOTrainer). ``bench/peers/export.py`` runs its
llama.cpp side where ``bench/.llama-venv`` exists (``bash bench/peers/setup_llama_cpp.sh``); the case
that requires it is likewise skipped without it, except under ``PPO_SOAK=1``.

Two smoke runs are ``make soak``'s alone (:data:`SOAK_ONLY`), each with a short variant in
``make test`` that fails on the same break: ``gpu.sh``'s steps with ``--options-only`` (here), and
``orchestration.py``'s reading of the flow's log on the flow run of ``tests/flows/test_flow.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PYTHON = ROOT / ".venv" / "bin" / "python"
TRL_VENV = BENCH / ".trl-venv"
LLAMA_VENV = BENCH / ".llama-venv"
SOAK = os.environ.get("PPO_SOAK") == "1"
TIMEOUT_S = 900

SLOW = {
    "answers.py",
    "data_parallel.py",
    "engine.py",
    "estimators.py",
    "gpu.sh",
    "grpo_vs_trl.py",
    "iteration_profile.py",
    "memory_scaling.py",
    "orchestration.py",
    "ppo_vs_trl.py",
    "precision.py",
    "sharding.py",
}
"""The smoke runs that took 20 s or more on two shared CPU cores: mostly the start of several processes that each import torch and transformers, and for
orchestration.py the whole pipeline twice (direct and through the flow)."""

SOAK_ONLY = {
    "gpu.sh": "test_gpu_sh_passes_each_step_options_it_takes",
    "orchestration.py": "tests/flows/test_flow.py (the flow's log read by the bench's parsers)",
}
"""Smoke runs of several minutes on 2 CPU cores (gpu.sh 427 s: each step's own smoke again;
orchestration.py 235 s: the whole pipeline twice) that only ``make soak`` runs, and the short
variant ``make test`` runs in their place."""

MACHINE_KEYS = ("cpu_capability", "matmul_fp32_gflops", "matmul_bf16_gflops")
"""What every JSON result's top-level ``machine`` block (``bench/common.py``'s ``machine()``) holds
at least: the CPU and its fp32 and bf16 matmul rates, without which a number cannot be read (an
AVX2 CPU emulates bf16; one with AVX-512 BF16 or AMX does not)."""

EXTRA_ARGS = {
    "ppo_vs_trl.py": ["--sides", "ours", "ours_shared"],
    "grpo_vs_trl.py": ["--sides", "ours"],
}
"""Options added to a benchmark's ``--smoke``; TRL's side of ``ppo_vs_trl.py`` is its own case."""


def benchmarks() -> list[Path]:
    """Every benchmark script in ``bench/<group>/``, by name."""
    found = [*BENCH.glob("*/*.py"), *BENCH.glob("*/*.sh")]
    return sorted(p for p in found if not p.name.startswith(("_", "setup_")))


def module_of(script: Path) -> str:
    """``bench/real/real_model.py`` -> ``bench.real.real_model``."""
    return ".".join(script.relative_to(ROOT).with_suffix("").parts)


def smoke_command(script: Path, *extra: str) -> list[str]:
    if script.suffix == ".sh":
        device = [] if torch.cuda.is_available() else ["--device", "cpu"]
        return ["bash", str(script), "--smoke", *device, *extra]
    python = str(PYTHON) if PYTHON.exists() else sys.executable
    return [python, "-m", module_of(script), "--smoke", *extra]


def untouched_outputs() -> dict[str, tuple[int, int]]:
    """What the full runs write in the repository: ``bench/results/`` and the plots in
    ``docs/``, by path, with each file's modification time and size."""
    files = [*(BENCH / "results").rglob("*"), *(ROOT / "docs").glob("*.png")]
    return {str(f): (f.stat().st_mtime_ns, f.stat().st_size) for f in files if f.is_file()}


def numbers(value) -> list[float]:
    """The non-integer numbers anywhere in a parsed JSON value."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [n for item in value for n in numbers(item)]
    return []


def run_smoke(script: Path, tmp_path: Path, *extra: str) -> tuple[str, list[dict]]:
    """Run ``script``'s smoke mode with ``$TMPDIR`` in ``tmp_path``; its output (stdout and
    stderr) and the JSON results it wrote, after the checks every benchmark passes."""
    name = script.relative_to(BENCH)
    if "--smoke" not in script.read_text():
        pytest.fail(
            f"bench/{name} has no --smoke mode: every benchmark needs one (the smallest sizes, "
            "one repeat, outputs to a temporary folder: see bench/common.py), or a name starting "
            "with '_' if it is a helper that a benchmark runs"
        )
    before = untouched_outputs()
    env = dict(os.environ, TMPDIR=str(tmp_path))
    try:
        done = subprocess.run(
            smoke_command(script, *extra),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"bench/{name} --smoke ran over {TIMEOUT_S} s:\n{str(exc.output)[-3000:]}")
    output = done.stdout + done.stderr
    if "unrecognized arguments: --smoke" in output:
        pytest.fail(f"bench/{name} does not accept --smoke: every benchmark needs a smoke mode")
    assert done.returncode == 0, f"bench/{name} --smoke exited {done.returncode}:\n{output[-6000:]}"
    assert "Traceback (most recent call last)" not in output, output[-6000:]
    assert untouched_outputs() == before, f"bench/{name} --smoke wrote into bench/results or docs"
    files = sorted(tmp_path.glob("bench-smoke-*/*.json"))
    assert files, f"bench/{name} --smoke wrote no JSON result to a temporary folder:\n{output}"
    results = [json.loads(f.read_text()) for f in files]
    for file, result in zip(files, results, strict=True):
        block = result.get("machine") if isinstance(result, dict) else None
        missing = [key for key in MACHINE_KEYS if not isinstance(block, dict) or key not in block]
        assert not missing, (
            f"bench/{name} --smoke wrote {file.name} without {', '.join(missing)} in a top-level "
            "'machine' block: every result says what it was measured on "
            '("machine": common.machine(), bench/common.py)'
        )
    measured = [n for result in results for n in numbers(result) if math.isfinite(n)]
    assert measured, f"no measured number in {[str(f) for f in files]}"
    return output, results


def smoke_marks(name: str) -> list:
    """``slow`` for the runs in :data:`SLOW`; ``soak`` and a skip outside ``make soak`` (before
    any fixture is built) for those in :data:`SOAK_ONLY`."""
    marks = [pytest.mark.slow] if name in SLOW else []
    if name in SOAK_ONLY:
        reason = f"make soak runs it (PPO_SOAK=1); make test runs {SOAK_ONLY[name]}"
        marks += [pytest.mark.soak, pytest.mark.skipif(not SOAK, reason=reason)]
    return marks


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(
            path,
            id=path.name,
            marks=smoke_marks(path.name),
        )
        for path in benchmarks()
    ],
)
def test_smoke_run(script: Path, tmp_path: Path):
    """The benchmark's smoke run succeeds and measures something."""
    _, results = run_smoke(script, tmp_path, *EXTRA_ARGS.get(script.name, []))
    if script.name == "ppo_vs_trl.py":
        for row in results[0]["median"].values():
            for side in ("ours", "ours_shared"):
                assert row[side]["iteration_s"] > 0


def test_gpu_sh_passes_each_step_options_it_takes():
    """``bench/gpu/gpu.sh --options-only`` runs each of its steps (both throughput runs, the
    memory run, the engine for each shape, the sharding run) until it has parsed the options the
    script passes, so that one a step no longer takes fails here in seconds."""
    done = subprocess.run(
        ["bash", str(BENCH / "gpu" / "gpu.sh"), "--smoke", "--device", "cpu", "--options-only"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    read = [line.split(":")[0] for line in done.stdout.splitlines() if ": options read" in line]
    engine = ["bench.speed.engine"] * 3 if "bench/speed/engine.py skipped" not in output else []
    assert read == [
        "bench.gpu.gpu_throughput",
        "bench.gpu.gpu_throughput",
        "bench.speed.memory_scaling",
        *engine,
        "bench.speed.sharding",
    ], output


@pytest.mark.slow
@pytest.mark.soak
def test_ppo_vs_trl_smoke_of_the_trl_side(tmp_path: Path):
    """TRL 1.12's side of ``bench/peers/ppo_vs_trl.py`` runs and is timed per iteration."""
    if not (TRL_VENV / "bin" / "python").exists():
        reason = f"{TRL_VENV} is missing (bash bench/peers/setup_trl.sh builds it)"
        if SOAK:
            pytest.fail(f"PPO_SOAK=1 runs TRL's side of bench/peers/ppo_vs_trl.py, but {reason}")
        pytest.skip(f"TRL's side of bench/peers/ppo_vs_trl.py not run: {reason}")
    _, results = run_smoke(BENCH / "peers" / "ppo_vs_trl.py", tmp_path, "--sides", "trl")
    (result,) = results
    for row in result["median"].values():
        assert row["trl"]["iteration_s"] > 0
    assert result["trl_reached"]["parameter_dtype"] == "torch.float32"


@pytest.mark.slow
@pytest.mark.soak
def test_grpo_vs_trl_smoke_of_the_trl_side(tmp_path: Path):
    """TRL 1.12's GRPOTrainer side of ``bench/peers/grpo_vs_trl.py`` trains with the project's
    verifier, in fp32 without gradient checkpointing, and its adapter is judged by our
    ``evaluate``."""
    if not (TRL_VENV / "bin" / "python").exists():
        reason = f"{TRL_VENV} is missing (bash bench/peers/setup_trl.sh builds it)"
        if SOAK:
            pytest.fail(f"PPO_SOAK=1 runs TRL's side of bench/peers/grpo_vs_trl.py, but {reason}")
        pytest.skip(f"TRL's side of bench/peers/grpo_vs_trl.py not run: {reason}")
    _, results = run_smoke(BENCH / "peers" / "grpo_vs_trl.py", tmp_path, "--sides", "trl")
    (result,) = results
    trl = result["sides"]["trl"]
    assert trl["iterations"] >= 1 and trl["parameter_dtype"] == "torch.float32"
    assert trl["gradient_checkpointing"] is False
    assert trl["held_out"]["num_samples"] > 0


@pytest.mark.slow
@pytest.mark.soak
def test_export_smoke_in_llama_cpp(tmp_path: Path):
    """llama.cpp (llama-cpp-python) loads the f16 file ``bench/peers/export.py`` exports from the tiny
    chat model, renders each chat with the file's own template to the pipeline's prompt ids, and
    continues it greedily to the pipeline's tokens."""
    if not (LLAMA_VENV / "bin" / "python").exists():
        reason = f"{LLAMA_VENV} is missing (bash bench/peers/setup_llama_cpp.sh builds it)"
        if SOAK:
            pytest.fail(f"PPO_SOAK=1 runs llama.cpp's side of bench/peers/export.py, but {reason}")
        pytest.skip(f"llama.cpp's side of bench/peers/export.py not run: {reason}")
    _, results = run_smoke(BENCH / "peers" / "export.py", tmp_path)
    (result,) = results
    assert result["llama_cpp"] == "run"
    f16 = result["types"]["f16"]
    assert f16["prompts_equal"] == f16["identical"] == result["chats"], f16["chats"]
