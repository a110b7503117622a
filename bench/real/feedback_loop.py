"""The feedback loop on a real model: SmolLM2-135M-Instruct learns a reward model from
preference pairs of its own replies, then PPO trains against it, and a gold preference that only
this script knows says whether the policy really got better (docs/training.md, "Learning the
reward from feedback").

1. Pairs: the imported base answers ``--pair-prompts`` chat requests for a one-sentence film
   review ``--replies`` times each (temperature 1, up to 64 tokens), and its replies to a
   prompt are paired off two by two. The gold preference, standing in for the people who would
   label them, is the built-in VADER sentiment of the reply (``builtin:sentiment``): the happier
   reply is chosen; pairs whose gold scores differ by less than ``--min-gap`` are dropped, as an
   annotator would skip a tie.
2. ``ppo prepare``, ``ppo validate`` and ``ppo reward`` (LoRA on SmolLM2 with a new scalar head,
   in ``--reward-precision``) make the pairs a checked version and train, judge and promote the
   reward model ``r0001``; its held-out accuracy is accuracy against gold.
3. ``ppo train`` with ``model.reward=reward:current`` (the recipe of ``bench/real/real_model.py``),
   then ``ppo evaluate`` and ``ppo promote`` (the gate's check reward is AFINN, independent of
   both). Every rollout's replies are also scored by gold (the reward function the run builds is
   wrapped here, in this process only), so each iteration has a proxy score (the reward model's,
   standardised) and a gold score: the curve of Gao et al. (2022), "Scaling Laws for Reward Model
   Overoptimization".
4. The candidate and the base are scored by gold on the held-out prompts (``ppo evaluate`` with
   ``eval.reward=builtin:sentiment`` into a folder of its own), with standard errors.

Writes ``bench/results/feedback_loop.json`` and ``bench/results/feedback_loop.png``.

    .venv/bin/python -m bench.real.feedback_loop            # about an hour on 2 CPU cores
    .venv/bin/python -m bench.real.feedback_loop --smoke    # the tiny default, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLD = "builtin:sentiment"

REWARD_MODEL = [
    "reward_model.lora=true",
    "reward_model.lora_rank=16",
    "reward_model.lora_alpha=32",
    "reward_model.lr=5e-4",
    "reward_model.epochs=2",
    "reward_model.batch_size=16",
    "reward_model.micro_batch_size=8",
    "validation.max_tokens=192",
    "validation.min_train_pairs=64",
    "validation.min_eval_pairs=16",
]
"""The reward model's settings: LoRA rank 16 on every linear layer of SmolLM2's trunk and the
whole new head, two epochs."""

SMOKE = [
    "train.iterations=2",
    "ppo.rollout_batch_size=8",
    "ppo.mini_batch_size=8",
    "ppo.micro_batch_size=4",
    "generation.max_new_tokens=4",
    "eval.num_prompts=4",
    "validation.max_tokens=256",
    "validation.min_train_pairs=4",
    "validation.min_eval_pairs=1",
    "reward_model.epochs=1",
    "reward_model.gate.min_accuracy=0",  # a smoke run's reward model learns nothing in a step
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ppo-feedback-loop"))
    parser.add_argument("--prompts", type=int, default=560, help="chat prompts for PPO")
    parser.add_argument("--pair-prompts", type=int, default=560, help="prompts to make pairs of")
    parser.add_argument(
        "--replies", type=int, default=4, help="replies to each pair prompt, paired two by two"
    )
    parser.add_argument(
        "--reward-precision",
        choices=("fp32", "bf16"),
        default="bf16",
        help="the reward stage's precision (PPO keeps the recipe's fp32); bf16 is 2.4x faster "
        "on a CPU with bf16 instructions (AVX-512 BF16 or AMX), slower on one without",
    )
    parser.add_argument(
        "--min-gap",
        type=float,
        default=0.3,
        help="smallest gold difference of a pair (VADER's compound score, -1 to 1)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value settings")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "feedback_loop.json"
    )
    from bench import common

    parser.add_argument(
        "--reuse-reward",
        action="store_true",
        help="keep the pairs and the reward version of an earlier run in --work and run only "
        "PPO, the evaluations and the gate again (e.g. with other --set PPO settings)",
    )
    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    if args.replies < 2:
        parser.error(f"--replies must be at least 2 (a pair), got {args.replies}")
    return args


def main() -> None:
    from bench import common

    args = parse_args()
    overrides = [*common.TRAINING, *REWARD_MODEL, f"threads={args.threads}"]
    if args.smoke:
        from bench import common

        smoke = common.output_folder("feedback_loop")
        if not args.reuse_reward:  # a reuse keeps the smoke project it is given in --work
            args.work = smoke / "project"
        args.out = smoke / "feedback_loop.json"
        args.prompts, args.pair_prompts, args.min_gap = 200, 100, 0.0
        source = str(common.smoke_chat_model(smoke / "tiny"))
        overrides += SMOKE
    else:
        source = str(common.smollm2_gguf())
    run(args, source, [*overrides, "model.reward=reward:current", *args.set])


def make_pairs(config, prompts, replies: int, min_gap: float) -> tuple[list[dict], dict]:
    """``replies`` replies of the base to each prompt, paired off two by two, the gold-happier
    one of a pair chosen."""
    import torch

    from ppo_core.experience.sampling import sample_responses, score_responses
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.policy import load_causal_lm
    from ppo_core.parallel.runtime import setup_runtime
    from ppo_core.rewards.loading import build_reward_fn

    runtime = setup_runtime(config, distributed=False)
    policy = load_causal_lm(config.model.policy, "policy").to(runtime.device)
    tokenizer = load_tokenizer(config.model.policy)
    doubled = [p for p in prompts for _ in range(2 * (replies // 2))]
    torch.manual_seed(2026)
    generated = sample_responses(
        policy, tokenizer, doubled, config.generation, runtime, chunk_size=32
    )
    texts, gold = score_responses(build_reward_fn(GOLD), tokenizer, doubled, generated)
    pairs, skipped = [], 0
    for i in range(0, len(doubled), 2):
        (a, b), (ga, gb) = texts[i : i + 2], gold[i : i + 2].tolist()
        if abs(ga - gb) < min_gap or not a.strip() or not b.strip() or a.strip() == b.strip():
            skipped += 1
            continue
        chosen, rejected = (a, b) if ga > gb else (b, a)
        pairs.append({"messages": doubled[i], "chosen": chosen, "rejected": rejected})
    longer = sum(len(p["chosen"]) > len(p["rejected"]) for p in pairs)
    return pairs, {
        "prompts": len(prompts),
        "replies_per_prompt": 2 * (replies // 2),
        "pairs": len(pairs),
        "skipped": skipped,
        "chosen_longer_share": longer / max(1, len(pairs)),
    }


class GoldRecorder:
    """Wraps the run's reward function: passes its scores through and records, per call, the
    mean proxy score and the mean gold score of the same replies."""

    def __init__(self) -> None:
        from ppo_core.rewards.loading import build_reward_fn

        self.gold = build_reward_fn(GOLD)
        self.calls: list[dict] = []

    def wrap(self, reward_fn):
        def scored(prompts, responses):
            proxy = reward_fn(prompts, responses)
            gold = self.gold(prompts, responses)
            self.calls.append(
                {"n": len(responses), "proxy": float(proxy.mean()), "gold": float(gold.mean())}
            )
            return proxy

        return scored

    def by_iteration(self, rollout_batch: int) -> list[dict]:
        """The calls grouped into iterations of ``rollout_batch`` replies each."""
        rows, taken, proxy, gold = [], 0, 0.0, 0.0
        for call in self.calls:
            taken += call["n"]
            proxy += call["proxy"] * call["n"]
            gold += call["gold"] * call["n"]
            if taken >= rollout_batch:
                rows.append({"proxy": proxy / taken, "gold": gold / taken})
                taken, proxy, gold = 0, 0.0, 0.0
        return rows


def run(args: argparse.Namespace, source: str, overrides: list[str]) -> None:
    from ppo_core.config import load_config

    if args.reuse_reward:
        os.chdir(args.work)
        config = load_config(overrides=[f"base.source={source}", *overrides])
        pair_counts, decision, timeline = reused_reward(args, config)
    else:
        pair_counts, decision, timeline = learn_reward(args, source, overrides)
        config = load_config(overrides=[f"base.source={source}", *overrides])
    if decision.get("decision") != "promoted":
        # no reward version to train against: say how far the reward model got, and stop
        print(json.dumps({"pairs": pair_counts, "reward_model": decision}, indent=1))
        raise SystemExit(f"the reward model was {decision.get('decision')}: no PPO run")
    promotion, curve = train_against_the_reward(config, source, overrides, timeline)
    report(args, config, pair_counts, decision, promotion, curve, timeline)


def learn_reward(args: argparse.Namespace, source: str, overrides: list[str]):
    """Steps 1 and 2 in a new work folder: the base, the prompts, the gold-labelled pairs and
    the reward model; returns the pair counts, the reward stage's decision and the times."""
    from bench import common
    from flows import stages
    from flows.loggers import ConsoleProgress
    from flows.reward_stage import reward
    from ppo_core.config import load_config
    from ppo_core.prompts import load_prompts

    if args.work.exists():
        shutil.rmtree(args.work)
    (args.work / "data" / "raw").mkdir(parents=True)
    (args.work / "data" / "feedback").mkdir(parents=True)
    os.chdir(args.work)
    rows = common.chat_prompts(args.prompts)
    (args.work / "data" / "raw" / "chats.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows)
    )
    config = load_config(overrides=[f"base.source={source}", *overrides])
    timeline: dict[str, float] = {}
    started = time.perf_counter()
    stages.base(config)
    stages.prepare(config)
    stages.validate(config)
    # both splits' prompts: the feedback is split by prompt as the prompts are, so the reward
    # model's held-out pairs answer PPO's held-out prompts, which it never trained on
    pool = load_prompts(args.work / "data" / "raw" / "chats.jsonl", config.data.prompt_field)
    pairs, pair_counts = make_pairs(config, pool[: args.pair_prompts], args.replies, args.min_gap)
    (args.work / "data" / "feedback" / "pairs.jsonl").write_text(
        "".join(json.dumps(pair) + "\n" for pair in pairs)
    )
    (args.work / PAIR_COUNTS).write_text(json.dumps(pair_counts, indent=1))
    timeline["pairs_s"] = time.perf_counter() - started
    started = time.perf_counter()
    stages.prepare(config)
    stages.validate(config)
    reward_config = load_config(
        overrides=[f"base.source={source}", *overrides, f"precision={args.reward_precision}"]
    )
    steps = ConsoleProgress(0, label="reward model", unit="step")
    decision = reward(reward_config, on_step=steps.step)
    steps.close()
    timeline["reward_s"] = time.perf_counter() - started
    (args.work / TIMELINE).write_text(json.dumps(timeline, indent=1))
    return pair_counts, decision, timeline


PAIR_COUNTS, TIMELINE = "pair_counts.json", "reward_timeline.json"
"""What ``learn_reward`` leaves in the work folder for a ``--reuse-reward`` run."""


def reused_reward(args: argparse.Namespace, config):
    """``--reuse-reward``: the pairs and the reward version of an earlier run in ``--work``, and
    none of its PPO outputs (checkpoints, candidate, evaluations, production)."""
    outputs = (config.train.checkpoint_dir, config.train.output_dir, config.train.metrics_dir)
    for folder in (*outputs, config.promote.production_dir, config.eval.output_dir):
        shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree("reports/eval-gold", ignore_errors=True)
    for leftover in (config.promote.registry, config.promote.report):
        Path(leftover).unlink(missing_ok=True)
    decision = json.loads((Path(config.reward_model.report_dir) / "decision.json").read_text())
    pair_counts = json.loads(Path(PAIR_COUNTS).read_text()) if Path(PAIR_COUNTS).exists() else {}
    timeline = json.loads(Path(TIMELINE).read_text()) if Path(TIMELINE).exists() else {}
    return pair_counts, decision, {**timeline, "reward_reused": 1.0}


def train_against_the_reward(config, source: str, overrides: list[str], timeline: dict):
    """Steps 3 and 4: PPO against ``reward:current`` with every rollout also scored by gold,
    the evaluation and the gate, and the held-out gold scores; returns the promotion decision
    and the proxy/gold curve."""
    import ppo_core.training.inputs as training_inputs
    from flows import stages
    from ppo_core.config import load_config

    recorder = GoldRecorder()
    original = training_inputs.build_reward
    training_inputs.build_reward = lambda *a, **k: recorder.wrap(original(*a, **k))
    started = time.perf_counter()
    try:
        summary = stages.train(config, show_progress=True)
    finally:
        training_inputs.build_reward = original
    timeline["train_s"] = time.perf_counter() - started
    started = time.perf_counter()
    stages.evaluate(config)
    promotion = stages.promote(config)
    gold_config = load_config(
        overrides=[
            f"base.source={source}",
            *overrides,
            f"eval.reward={GOLD}",
            "eval.output_dir=reports/eval-gold",
            # the base, not production: a promoted candidate is production by now
            f"eval.baseline={config.model.policy}",
        ]
    )
    stages.evaluate(gold_config)
    timeline["evaluate_s"] = time.perf_counter() - started
    curve = recorder.by_iteration(config.ppo.rollout_batch_size)
    for row, past in zip(curve, summary.history, strict=False):
        row["kl"] = past["rollout/kl"]
    return promotion, curve


def held_out(folder: Path, responses: int) -> dict:
    metrics = json.loads((folder / "metrics.json").read_text())
    sides = {}
    for side in ("candidate", "baseline"):
        score, std = metrics[f"{side}/score"], metrics[f"{side}/score_std"]
        sides[side] = {"score": score, "stderr": std / math.sqrt(responses)}
    gain = sides["candidate"]["score"] - sides["baseline"]["score"]
    stderr = math.hypot(sides["candidate"]["stderr"], sides["baseline"]["stderr"])
    return {**sides, "gain": gain, "gain_stderr": stderr, "gain_in_stderr": gain / stderr}


def overoptimisation(curve: list[dict], max_kl: float) -> dict:
    """Where gold stops rising while the proxy goes on (the iteration of the best gold, over a
    moving average of 5), and where the KL first exceeds the gate's budget ``max_kl``."""
    smooth = []
    for i in range(len(curve)):
        window = curve[max(0, i - 4) : i + 1]
        smooth.append(sum(r["gold"] for r in window) / len(window))
    best = max(range(len(smooth)), key=smooth.__getitem__) if smooth else None
    over_budget = next((i for i, r in enumerate(curve) if r.get("kl", 0) > max_kl), None)
    return {
        "gold_peak_iteration": None if best is None else best + 1,
        "gold_smoothed": smooth,
        "kl_over_budget_iteration": None if over_budget is None else over_budget + 1,
    }


def plot(curve: list[dict], marks: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(curve) + 1)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    left.plot(steps, [r["proxy"] for r in curve], label="proxy: reward model (standardised)")
    left.plot(steps, [r["gold"] for r in curve], label="gold: VADER sentiment")
    left.plot(steps, marks["gold_smoothed"], "--", label="gold, moving mean of 5")
    for key, style, text in (
        ("gold_peak_iteration", ":", "gold peaks"),
        ("kl_over_budget_iteration", "-.", "KL over the gate's budget"),
    ):
        if marks.get(key):
            left.axvline(marks[key], linestyle=style, color="grey", label=text)
    left.set_xlabel("PPO iteration")
    left.set_title("Proxy and gold reward of the rollouts")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    # points, not a line: the KL of successive iterations goes back and forth
    right.plot([r.get("kl", math.nan) for r in curve], [r["proxy"] for r in curve], "o", ms=4)
    right.plot([r.get("kl", math.nan) for r in curve], [r["gold"] for r in curve], "o", ms=4)
    right.set_xlabel("KL to the base (nats per reply)")
    right.set_title("Against the KL (Gao et al. 2022)")
    right.legend(["proxy", "gold"], fontsize=8)
    right.grid(alpha=0.3)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def report(args, config, pair_counts, decision, promotion, curve, timeline) -> None:
    import torch

    from bench import common

    responses = config.eval.num_prompts * config.eval.samples_per_prompt
    marks = overoptimisation(curve, config.promote.max_kl)
    result = {
        "model": "tiny" if args.smoke else "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "pairs": pair_counts,
        "reward_model": {
            "decision": decision.get("decision"),
            "version": decision.get("version"),
            "held_out_accuracy_against_gold": decision.get("metrics", {}).get("accuracy"),
            "metrics": decision.get("metrics"),
            "reasons": decision.get("reasons"),
        },
        "ppo_held_out_proxy": held_out(Path(config.eval.output_dir), responses),
        "ppo_held_out_gold": held_out(Path("reports/eval-gold"), responses),
        "promotion": {"decision": promotion.get("decision"), "reasons": promotion.get("reasons")},
        "curve": curve,
        "overoptimisation": {k: v for k, v in marks.items() if k != "gold_smoothed"},
        "timeline_s": timeline,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # 2048-cube products (256 under --smoke: one emulated bf16 2048-cube takes a minute)
        "matmul_gflops_2048": {
            name: common.matmul_peak_gflops(
                args.threads, size=256 if args.smoke else 2048, dtype=dtype
            )
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        },
        "threads": args.threads,
        "machine": common.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(curve, marks, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}, indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
