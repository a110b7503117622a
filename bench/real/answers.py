"""A real model learning a skill that can be checked: SmolLM2-135M-Instruct, imported from its
GGUF file, asked arithmetic questions whose rows carry the answer (``data.reference_fields``),
rewarded by ``builtin:math_answer`` against it.

``--probe`` measures the imported base's held-out accuracy and pass@k on each task, through
the pipeline's own ``prepare``, ``validate`` and ``evaluate``, to pick tasks it solves neither
never nor always. Without it, one task is trained (LoRA, the settings below plus ``--set``),
evaluated against the base and judged by the gate (``promote.min_gain_se``); it writes
``bench/results/answers_<task>.json`` (accuracy and pass@k of both models, the rollout's
accuracy by iteration and by wall clock, the gate's reasons, the machine) and a plot beside it.

    .venv/bin/python -m bench.real.answers --probe                 # about 6 minutes on 2 cores
    .venv/bin/python -m bench.real.answers --probe-gym             # the reasoning-gym tasks
    .venv/bin/python -m bench.real.answers --task add2 --set seed=1
    .venv/bin/python -m bench.real.answers --smoke                 # the tiny default, seconds
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from bench import common
from bench.common import machine, smoke_chat_model, smollm2_gguf, start_chat_project

ROOT = Path(__file__).resolve().parents[2]

TASKS = {
    "add1": ("+", range(0, 10), range(0, 10)),
    "add2": ("+", range(10, 100), range(10, 100)),
    "mul1": ("*", range(2, 10), range(2, 10)),
    "sub2": ("-", range(10, 100), range(10, 100)),
}
"""Each task's operator and the ranges of its two operands (a subtraction's first is the
larger)."""

ASK = "What is {a} {op} {b}? Answer with the number only."

SETTINGS = [
    "data.reference_fields=[answer]",
    "model.reward=builtin:math_answer",
    "model.lora.enabled=true",
    "model.lora.rank=16",
    "model.lora.alpha=32",
    "model.critic=none",
    "ppo.advantage_estimator=grpo",
    "ppo.samples_per_prompt=8",
    "ppo.rollout_batch_size=32",
    "ppo.mini_batch_size=16",
    "ppo.micro_batch_size=8",
    "ppo.epochs=1",
    "ppo.old_logprobs=sampling",
    "generation.max_new_tokens=32",
    "optim.lr=2e-4",
    "kl.coef=0.25",
    "train.iterations=25",
    "validation.max_tokens=128",
    "validation.min_train_rows=32",
    "eval.num_prompts=100",
    "eval.samples_per_prompt=4",
    "eval.num_examples=6",
    "ppo.missing_eos_penalty=1.0",
    "promote.min_gain_se=3",
    "promote.min_improvement=0.0",
    "promote.max_distinct_2_drop=null",
]
"""The run's settings (``--set`` overrides any of them): GRPO over eight replies a question
(a group of right and wrong replies is what the estimator learns from), 32 new tokens (a reply
cut there loses 1.0 in training: the base ends only half its replies), ``kl.coef=0.25``,
held-out accuracy on 100 questions, four replies each, and a gate that asks for a gain of three
standard errors. Distinct-2 is no guard here: a right answer is one number. With these settings
two seeds were promoted (held-out accuracy 0.09 -> 0.52 and 0.31; docs/training.md); a smaller
KL coefficient learnt more (0.99 at ``kl.coef=0.05``) but drifted past the gate's KL budget of
4 nats, and a 0.5 penalty left the EOS rate just under the gate's 0.85."""


def rows(task: str, count: int, seed: int) -> list[dict]:
    """``count`` distinct questions of ``task`` (fewer when the task has fewer), each a chat
    row with its ``answer``."""
    op, first, second = TASKS[task]
    draw = random.Random(seed)
    seen: dict[str, str] = {}
    for _ in range(count * 20):
        a, b = draw.choice(first), draw.choice(second)
        if op == "-" and a < b:
            a, b = b, a
        value = a + b if op == "+" else a * b if op == "*" else a - b
        seen.setdefault(ASK.format(a=a, op=op, b=b), str(value))
        if len(seen) == count:
            break
    return [
        {"messages": [{"role": "user", "content": question}], "answer": answer}
        for question, answer in seen.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ppo-answers"))
    parser.add_argument("--task", choices=sorted(TASKS), default="add2")
    parser.add_argument("--probe", action="store_true", help="the base's accuracy on each task")
    parser.add_argument(
        "--probe-gym",
        action="store_true",
        help="the base's accuracy on each reasoning-gym task used here (builtin:reasoning_gym)",
    )
    parser.add_argument("--questions", type=int, default=600)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value settings")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    parser.add_argument(
        "--plot-runs",
        nargs="+",
        type=Path,
        help="draw the curves of these results into one plot (--out, a .png) and stop",
    )
    args = parser.parse_args()
    if args.out is not None:  # the stages run in the project folder (--work): made absolute first
        args.out = args.out.resolve()
    if args.plot_runs:
        runs = [json.loads(path.read_text()) for path in args.plot_runs]
        plot_runs(runs, args.out or ROOT / "bench" / "results" / "answers_runs.png")
        return
    overrides = [*SETTINGS, f"threads={args.threads}"]
    if args.smoke:
        smoke = common.output_folder("answers")
        args.work, args.questions = smoke / "project", 200
        args.out = args.out or smoke / "answers.json"
        source = str(smoke_chat_model(smoke / "tiny"))
        overrides += [*common.SMOKE_TRAINING, "ppo.samples_per_prompt=4"]
    else:
        source = str(smollm2_gguf())
    overrides += args.set
    if args.probe_gym:
        probe_gym(args, source, overrides)
    elif args.probe:
        probe(args, source, overrides)
    else:
        train(args, source, overrides)


GYM_SETTINGS = [
    "data.reference_fields=[answer,task,metadata]",
    "model.reward=builtin:reasoning_gym",
    "validation.max_tokens=320",
    "generation.max_new_tokens=96",
]
"""What the reasoning-gym probe changes: the rows' three fields and the task's own scorer,
questions up to 320 tokens (``letter_counting`` quotes a paragraph), and room for a short
working before the answer tags."""


def probe(args: argparse.Namespace, source: str, overrides: list[str]) -> None:
    """Each arithmetic task's held-out accuracy and pass@k for the imported base."""
    tasks = ["add1", "mul1"] if args.smoke else list(TASKS)
    measure_base(args, source, overrides, {task: rows(task, 200, 0) for task in tasks}, "probe")


def probe_gym(args: argparse.Namespace, source: str, overrides: list[str]) -> None:
    """Each reasoning-gym task's held-out accuracy and pass@k for the imported base, 64
    problems a task (seed 0; 32 held out, 4 replies each) generated by
    ``ppo_core/rewards/gym.py`` as ``ppo tasks`` does."""
    from ppo_core.rewards.gym import GYM_TASKS, gym_rows

    tasks = ["chain_sum", "count_bits"] if args.smoke else list(GYM_TASKS)
    problems = {task: gym_rows([task], 64, 0, chat=True) for task in tasks}
    measure_base(args, source, [*overrides, *GYM_SETTINGS], problems, "probe_gym")


def measure_base(
    args: argparse.Namespace,
    source: str,
    overrides: list[str],
    problems: dict[str, list[dict]],
    name: str,
) -> None:
    """The base's held-out accuracy, pass@k and verdicts on each task's ``problems``, written
    to ``bench/results/answers_<name>.json`` (or ``--out``)."""
    from ppo_core.evaluation.evaluate import evaluate

    # half the questions held out, so that the small tasks (64 and 100 questions) have enough
    held_out = [
        "data.eval_fraction=0.5",
        "validation.min_train_rows=8",
        "validation.min_eval_rows=8",
    ]
    found = {}
    for task, questions in problems.items():
        config = start_chat_project(args.work / task, questions, source, [*overrides, *held_out])
        started = time.perf_counter()
        report = evaluate(config, config.model.policy)["candidate"]
        found[task] = {
            key: report.metrics[key]
            for key in report.metrics
            if key in ("accuracy", "pass_at_1", "score_std", "num_samples", "eos_rate")
            or key.startswith(("pass_at_", "verdict/"))
        }
        found[task]["evaluate_s"] = time.perf_counter() - started
        print(task, json.dumps(found[task]), flush=True)
    out = args.out or ROOT / "bench" / "results" / f"answers_{name}.json"
    write(out, {"probe": found, "settings": overrides, "machine": machine()})


def train(args: argparse.Namespace, source: str, overrides: list[str]) -> None:
    """One task trained and judged; accuracy against iteration and wall clock."""
    from flows import stages

    config = start_chat_project(args.work, rows(args.task, args.questions, 0), source, overrides)
    started = time.perf_counter()
    summary = stages.train(config, show_progress=True)
    train_s = time.perf_counter() - started
    evaluation = stages.evaluate(config)
    promotion = stages.promote(config)
    history = summary.history
    clock, curve = 0.0, []
    for row in history:
        clock += row.get("perf/iteration_s", 0.0)
        curve.append(
            {
                "iteration": int(row["iteration"]),
                "seconds": clock,
                "accuracy": row["rollout/score"],
                "kl": row["rollout/kl"],
            }
        )
    sides = {
        name: {k: v for k, v in report.metrics.items() if not k.startswith("verdict/")}
        for name, report in evaluation.items()
    }
    result = {
        "task": args.task,
        "settings": overrides,
        "candidate": sides["candidate"],
        "baseline": sides.get("baseline"),
        "curve": curve,
        "train_s": train_s,
        "median_iteration_s": sorted(r.get("perf/iteration_s", 0.0) for r in history)[
            len(history) // 2
        ],
        "promotion": {"decision": promotion.get("decision"), "reasons": promotion.get("reasons")},
        "machine": machine(),
    }
    out = args.out or ROOT / "bench" / "results" / f"answers_{args.task}.json"
    write(out, result)
    plot(curve, out.with_suffix(".png"), args.task)


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


def plot(curve: list[dict], path: Path, task: str) -> None:
    """The rollout's accuracy against iteration and against wall clock, side by side."""
    plot_runs([{"task": task, "curve": curve, "settings": []}], path)


def plot_runs(runs: list[dict], path: Path) -> None:
    """Each run's rollout accuracy against iteration and against wall clock, side by side,
    labelled by its seed and KL coefficient, and its held-out accuracy as a dashed level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_clock) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for run in runs:
        settings = dict(s.split("=", 1) for s in run.get("settings", []) if "=" in s)
        label = f"seed {settings.get('seed', '0')}, kl.coef {settings.get('kl.coef', '?')}"
        accuracy = [row["accuracy"] for row in run["curve"]]
        line = by_step.plot([row["iteration"] for row in run["curve"]], accuracy, marker=".")
        by_clock.plot([row["seconds"] / 60 for row in run["curve"]], accuracy, marker=".")
        held_out = (run.get("candidate") or {}).get("accuracy")
        if held_out is not None:
            label += f": held out {held_out:.2f}"
            by_step.axhline(held_out, color=line[0].get_color(), linestyle="--", linewidth=0.8)
        line[0].set_label(label)
    base = (runs[0].get("baseline") or {}).get("accuracy")
    if base is not None:
        by_step.axhline(base, color="grey", linestyle=":", label=f"base, held out {base:.2f}")
    by_step.set_xlabel("iteration")
    by_step.set_ylabel("accuracy of the rollout's replies")
    by_clock.set_xlabel("wall clock, minutes")
    by_step.legend(fontsize=8)
    figure.suptitle(f"SmolLM2-135M-Instruct, LoRA GRPO, task {runs[0]['task']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
