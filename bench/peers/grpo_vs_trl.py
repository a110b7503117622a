"""GRPO side by side: this project's pipeline against TRL 1.12's GRPOTrainer on a skill that can be
checked, SmolLM2-135M-Instruct learning two-digit addition (bench/real/answers.py's task).

Both sides, one after the other on the same host, take the same base folder (SmolLM2 imported
from its GGUF file by ``ppo base``), the same training rows (this project's prepared train
split, each chat with its ``answer``), the same verifier (``MathAnswerChecker``, math-verify in a
worker process; TRL's ``reward_funcs``) plus the same missing-EOS penalty, and the same settings:
LoRA rank 16 (alpha 32) on every linear layer, 8 completions a prompt, 32 completions a
generation, optimizer steps of 16 in micro-batches of 8 (two steps an iteration), one pass,
``max_new_tokens`` new tokens at temperature 1, the KL to the base in the loss (k3, coefficient
``--kl``), clip 0.2, AdamW (0.9, 0.95) at a constant learning rate 2e-4, gradient norm 1, fp32,
``--threads`` threads, no gradient checkpointing (TRL's GRPO default is on; turned off).

Ours trains ``--iterations`` iterations through ``ppo train``'s stage; TRL trains until the same
wall clock has passed (from its training's start, as ours counts from its first iteration) or
the same number of iterations, whichever is first. Both adapters are then judged by this
project's ``evaluate`` on the same held-out questions (TRL's adapter in a copy of our candidate
folder): held-out accuracy after the same wall clock, and the seconds an iteration took.

    bash bench/peers/setup_trl.sh                  # once: bench/.trl-venv (trl, math-verify)
    .venv/bin/python -m bench.peers.grpo_vs_trl    # about 23 minutes on 2 cores
    .venv/bin/python -m bench.peers.grpo_vs_trl --smoke   # the tiny chat model; TRL with its venv

Writes ``bench/results/grpo_vs_trl.json`` and ``docs/grpo-vs-trl.png`` (``--smoke``: a
temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from bench import common
from bench.common import machine, smoke_chat_model, smollm2_gguf, start_chat_project
from bench.real import answers

ROOT = Path(__file__).resolve().parents[2]
TRL_PYTHON = ROOT / "bench" / ".trl-venv" / "bin" / "python"
ROLLOUT, MINI, MICRO, GENERATIONS, LORA_RANK, LR, EOS_PENALTY = 32, 16, 8, 8, 16, 2e-4, 1.0


def settings(iterations: int, kl: float, max_new_tokens: int, threads: int, seed: int) -> list:
    """Our side's overrides: bench/real/answers.py's task settings made TRL's GRPO (the KL as a
    k3 term of the loss at a fixed coefficient) in fp32."""
    return [
        "data.reference_fields=[answer]",
        "model.reward=builtin:math_answer",
        "model.lora.enabled=true",
        f"model.lora.rank={LORA_RANK}",
        f"model.lora.alpha={2 * LORA_RANK}",
        "model.critic=none",
        "ppo.advantage_estimator=grpo",
        f"ppo.samples_per_prompt={GENERATIONS}",
        f"ppo.rollout_batch_size={ROLLOUT}",
        f"ppo.mini_batch_size={MINI}",
        f"ppo.micro_batch_size={MICRO}",
        "ppo.epochs=1",
        "ppo.old_logprobs=sampling",
        "ppo.loss_agg_mode=token-mean",
        f"ppo.missing_eos_penalty={EOS_PENALTY}",
        f"generation.max_new_tokens={max_new_tokens}",
        f"optim.lr={LR}",
        "optim.scheduler=constant",
        "kl.in_loss=true",
        "kl.estimator=k3",
        "kl.adaptive=false",
        f"kl.coef={kl}",
        f"train.iterations={iterations}",
        "validation.max_tokens=128",
        "validation.min_train_rows=32",
        "eval.num_prompts=100",
        "eval.samples_per_prompt=4",
        "eval.num_examples=4",
        "precision=fp32",
        f"threads={threads}",
        f"seed={seed}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ppo-grpo-vs-trl"))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--kl", type=float, default=0.05)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--questions", type=int, default=600)
    parser.add_argument("--sides", nargs="+", choices=["ours", "trl"], default=["ours", "trl"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    if args.out is not None:
        args.out = args.out.resolve()
    if args.smoke:
        smoke = common.output_folder("grpo_vs_trl")
        args.work, args.questions, args.iterations = smoke / "project", 200, 2
        args.max_new_tokens, args.out = 6, args.out or smoke / "grpo_vs_trl.json"
        source = str(smoke_chat_model(smoke / "tiny"))
    else:
        source = str(smollm2_gguf())
    args.work = args.work.resolve()
    overrides = settings(args.iterations, args.kl, args.max_new_tokens, args.threads, args.seed)
    if args.smoke:
        overrides += [*common.SMOKE_TRAINING, "ppo.samples_per_prompt=4", "eval.num_prompts=8"]
    rows = answers.rows("add2", args.questions, 0)
    config = start_chat_project(args.work, rows, source, overrides)
    result = {"settings": overrides, "machine": machine(), "sides": {}}
    ours = run_ours(config)  # TRL's side trains for the wall clock ours took
    if "ours" in args.sides:
        result["sides"]["ours"] = ours
    if "trl" in args.sides:
        result["sides"]["trl"] = run_trl(args, config, overrides, ours["train_s"])
    out = args.out or ROOT / "bench" / "results" / "grpo_vs_trl.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    plot(
        result, out.parent / "grpo-vs-trl.png" if args.smoke else ROOT / "docs" / "grpo-vs-trl.png"
    )


def run_ours(config) -> dict:
    """Train and evaluate our side; its per-iteration seconds and held-out accuracy."""
    from flows import stages

    summary = stages.train(config, show_progress=True)
    seconds = [row.get("perf/iteration_s", 0.0) for row in summary.history]
    evaluation = stages.evaluate(config)
    return {
        "iterations": len(seconds),
        "iteration_s": seconds,
        "median_iteration_s": statistics.median(seconds),
        "train_s": sum(seconds),
        "curve": _curve(seconds, [row["rollout/score"] for row in summary.history]),
        **_held_out(evaluation),
    }


def run_trl(args, config, overrides: list[str], wall_s: float) -> dict:
    """Train TRL's side in its venv for ``wall_s`` seconds at most, then judge its adapter with
    our ``evaluate`` from a copy of our candidate folder."""
    work = args.work / "trl"
    work.mkdir(parents=True, exist_ok=True)
    job_file = work / "job.json"
    job_file.write_text(json.dumps(_trl_job(config, work, wall_s), indent=1))
    side = ROOT / "bench" / "peers" / "_trl_grpo_side.py"
    # the verifier's worker (python -m ppo_core.rewards.math_worker) finds the project there
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    subprocess.run(
        [str(TRL_PYTHON), str(side), "--job", str(job_file), "--out", str(work)],
        check=True,
        env=environment,
    )
    run_s = time.perf_counter() - started
    trl = json.loads((work / "trl.json").read_text())
    evaluation = _judge_trl(config, overrides, work / "adapter")
    per_iteration = max(1, config.ppo.rollout_batch_size // config.ppo.mini_batch_size)
    ends = trl["step_end_s"][per_iteration - 1 :: per_iteration]
    seconds = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]
    logged = trl["accuracy_by_step"]
    # TRL logs the rewards once a generation (an iteration), or with every step
    group = per_iteration if len(logged) > len(seconds) else 1
    accuracy = [statistics.mean(logged[i : i + group]) for i in range(0, len(logged), group)]
    return {
        "iterations": len(seconds),
        "iteration_s": seconds,
        "median_iteration_s": statistics.median(seconds) if seconds else None,
        "train_s": trl["step_end_s"][-1] if trl["step_end_s"] else 0.0,
        "process_s": run_s,
        "curve": _curve(seconds, accuracy[: len(seconds)]),
        "parameter_dtype": trl["parameter_dtype"],
        "mixed_precision": trl["mixed_precision"],
        "gradient_checkpointing": trl["gradient_checkpointing"],
        **_held_out(evaluation),
    }


def _trl_job(config, work: Path, wall_s: float) -> dict:
    """TRL's job: our prepared train rows (chat and answer) written for it, and our settings."""
    from ppo_core.prompts import load_prompts
    from ppo_core.references import load_references

    train_file = config.data.train_file
    prompts = load_prompts(train_file, config.data.prompt_field)
    answers_ = [row["answer"] for row in load_references(train_file, ["answer"])]
    rows_file = work / "rows.jsonl"
    rows_file.write_text(
        "".join(
            json.dumps({"messages": p, "answer": a}) + "\n"
            for p, a in zip(prompts, answers_, strict=True)
        )
    )
    ppo = config.ppo
    return {
        "root": str(ROOT),
        "policy": str(Path(config.model.policy).resolve()),
        "rows": str(rows_file),
        "output_dir": str(work / "trainer"),
        "threads": config.threads,
        "seed": config.seed,
        "wall_s": wall_s,
        "iterations": config.train.iterations,
        "rollout": ppo.rollout_batch_size,
        "mini": ppo.mini_batch_size,
        "micro": ppo.micro_batch_size,
        "generations": ppo.samples_per_prompt,
        "max_new_tokens": config.generation.max_new_tokens,
        "kl_coef": config.kl.coef,
        "lr": config.optim.lr,
        "lora_rank": config.model.lora.rank,
        "missing_eos_penalty": ppo.missing_eos_penalty,
    }


def _judge_trl(config, overrides: list[str], adapter: Path) -> dict:
    """Our ``evaluate`` of TRL's ``adapter``, put in a copy of our candidate folder."""
    from flows import stages
    from ppo_core.config import load_config

    candidate = Path(config.train.output_dir).resolve()
    copy = candidate.with_name("candidate_trl")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(candidate, copy)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy2(adapter / name, copy / name)
    judged = load_config(
        overrides=[
            *overrides,
            f"base.source={config.base.source}",
            f"train.output_dir={copy}",
            "eval.output_dir=reports/eval_trl",
        ]
    )
    return stages.evaluate(judged)


def _curve(seconds: list[float], accuracy: list[float]) -> list[dict]:
    clock, curve = 0.0, []
    for index, (step, score) in enumerate(zip(seconds, accuracy, strict=False), start=1):
        clock += step
        curve.append({"iteration": index, "seconds": clock, "accuracy": score})
    return curve


def _held_out(evaluation: dict) -> dict:
    keep = ("accuracy", "pass_at_1", "pass_at_4", "eos_rate", "kl_to_reference", "num_samples")
    sides = {name: report.metrics for name, report in evaluation.items()}
    return {
        "held_out": {k: sides["candidate"].get(k) for k in keep},
        "base_held_out": {k: (sides.get("baseline") or {}).get(k) for k in keep},
    }


def plot(result: dict, path: Path) -> None:
    """Each side's rollout accuracy against wall clock, its held-out accuracy dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    for name, side in result["sides"].items():
        label = {"ours": "ppo_core (this project)", "trl": "TRL 1.12 GRPOTrainer"}[name]
        curve = side["curve"]
        line = axis.plot(
            [row["seconds"] / 60 for row in curve], [row["accuracy"] for row in curve], marker="."
        )
        held = side["held_out"].get("accuracy")
        median = side.get("median_iteration_s")
        line[0].set_label(f"{label}: {median:.1f} s/iteration, held out {held:.2f}")
        axis.axhline(held, color=line[0].get_color(), linestyle="--", linewidth=0.8)
    axis.set_xlabel("training wall clock, minutes")
    axis.set_ylabel("accuracy of the rollout's replies")
    axis.legend(fontsize=8)
    axis.set_title("SmolLM2-135M-Instruct, LoRA GRPO on two-digit addition, fp32, same host")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
