"""A real pretrained model trained with LoRA PPO: SmolLM2-135M-Instruct, imported from its GGUF
file, asked for film reviews in chat form and rewarded by the built-in sentiment score.

The pipeline's own stages run one after the other in a project folder of their own (``--work``):
``base`` (the GGUF import), a chat prompt file written here (``--prompts`` requests to review
invented films), ``prepare``, ``validate``, ``train`` (LoRA, the keys below plus ``--set``) and
``evaluate`` (the trained adapter against the imported base on ``eval.num_prompts`` held-out
prompts, ``eval.samples_per_prompt`` responses each) and ``promote`` (the gate's decision). It
writes
``bench/results/real_model.json``: the held-out score of both models with its standard error,
the KL to the base, EOS rate, response length, distinct-2, six base/trained sample pairs, each
iteration's time split into generation, scoring, reward and update, the peak memory
(``ru_maxrss``), and the update's GFLOP/s against a measured fp32 matmul peak.

    .venv/bin/python -m bench.real.real_model                      # about 50 minutes on 2 CPU cores
    .venv/bin/python -m bench.real.real_model --set train.iterations=10 optim.lr=1e-4
    .venv/bin/python -m bench.real.real_model --smoke              # the tiny default, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import time
from pathlib import Path

import torch

from bench.common import (
    SMOKE_TRAINING,
    TRAINING,
    chat_prompts,
    machine,
    matmul_peak_gflops,
    smoke_chat_model,
    smollm2_gguf,
)

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ppo-real-model"))
    parser.add_argument("--prompts", type=int, default=560)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value settings")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real_model.json")
    from bench import common

    parser.add_argument(
        "--smoke", action="store_true", help=f"{common.HELP} (the model: common.tiny_model)"
    )
    args = parser.parse_args()
    source = None
    overrides = [*TRAINING, f"threads={args.threads}"]
    if args.smoke:
        smoke = common.output_folder("real_model")
        args.work, args.out, args.prompts = smoke / "project", smoke / "real_model.json", 200
        source = str(smoke_chat_model(smoke / "tiny"))
        overrides += SMOKE_TRAINING
    else:
        source = str(smollm2_gguf())
    run(args, source, [*overrides, *args.set])


def run(args: argparse.Namespace, source: str, overrides: list[str]) -> None:
    from flows import stages
    from ppo_core.config import load_config

    if args.work.exists():
        shutil.rmtree(args.work)
    (args.work / "data" / "raw").mkdir(parents=True)
    os.chdir(args.work)
    rows = chat_prompts(args.prompts)
    (args.work / "data" / "raw" / "chats.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows)
    )
    config = load_config(overrides=[f"base.source={source}", *overrides])
    timeline = {}
    started = time.perf_counter()
    stages.base(config)
    timeline["base_s"] = time.perf_counter() - started
    stages.prepare(config)
    stages.validate(config)
    started = time.perf_counter()
    summary = stages.train(config, show_progress=True)
    timeline["train_s"] = time.perf_counter() - started
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    started = time.perf_counter()
    stages.evaluate(config)
    timeline["evaluate_s"] = time.perf_counter() - started
    promotion = stages.promote(config)
    report(args, config, summary.history, timeline, peak_rss_gib, overrides, promotion)


def update_flops_per_iteration(config, history) -> float:
    """FLOPs of one iteration's update, estimated from the model's shapes.

    LoRA: the frozen weights need no weight gradient, but the backward pass still multiplies by
    them to pass gradients down (2 N per token) after the forward (2 N), so 4 N FLOPs per token
    and epoch, 6 N with the blocks recomputed by gradient checkpointing. N is the weights of the
    blocks for every token (prompt and response) plus the output layer for the response tokens
    only (the update computes logits there alone); attention scores and LoRA's own products are
    left out (a few percent here)."""
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.generation import prompt_token_ids
    from ppo_core.models.policy import load_causal_lm
    from ppo_core.prompts import load_prompts

    model = load_causal_lm(config.model.policy)
    total = sum(p.numel() for p in model.parameters())
    output = model.get_output_embeddings().weight.numel()
    blocks = total - output - (0 if model.config.tie_word_embeddings else output)
    prompts = load_prompts(config.data.train_file)[:256]
    prompt_tokens = statistics.mean(
        map(len, prompt_token_ids(load_tokenizer(config.model.policy), prompts))
    )
    response_tokens = statistics.median(row["rollout/response_length"] for row in history)
    factor = 6 if config.train.gradient_checkpointing else 4
    per_row = factor * (blocks * (prompt_tokens + response_tokens) + output * response_tokens)
    return per_row * config.ppo.rollout_batch_size * config.ppo.epochs


def report(args, config, history, timeline, peak_rss_gib, overrides, promotion) -> None:
    evaluation = Path(config.eval.output_dir)
    metrics = json.loads((evaluation / "metrics.json").read_text())
    samples = json.loads((evaluation / "samples.json").read_text())
    responses = config.eval.num_prompts * config.eval.samples_per_prompt

    def side(name: str) -> dict:
        found = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"{name}/")}
        found["score_stderr"] = found.get("score_std", 0.0) / math.sqrt(responses)
        return found

    candidate, baseline = side("candidate"), side("baseline")
    gain = candidate["score"] - baseline["score"]
    stderr = math.hypot(candidate["score_stderr"], baseline["score_stderr"])
    split = {
        key: statistics.median(row[f"perf/{key}"] for row in history)
        for key in ("generate_s", "score_s", "reward_s", "update_s", "iteration_s")
    }
    update_flops = update_flops_per_iteration(config, history)
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)"
        if not args.smoke
        else "tiny",
        "settings": overrides,
        "held_out_responses": responses,
        "baseline": baseline,
        "candidate": candidate,
        "gain": gain,
        "gain_stderr": stderr,
        "gain_in_stderr": gain / stderr if stderr else None,
        "iterations": len(history),
        "score_by_iteration": [row["rollout/score"] for row in history],
        "kl_by_iteration": [row["rollout/kl"] for row in history],
        "median_seconds_per_iteration": split,
        "timeline_s": timeline,
        "peak_rss_gib": peak_rss_gib,
        "update_gflops_per_s": update_flops / split["update_s"] / 1e9,
        "matmul_peak_gflops_per_s": matmul_peak_gflops(args.threads),
        "promotion": {"decision": promotion.get("decision"), "reasons": promotion.get("reasons")},
        "sample_pairs": list(
            zip(samples.get("baseline", []), samples.get("candidate", []), strict=False)
        )[:6],
        "torch": torch.__version__,
        "threads": args.threads,
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "sample_pairs"}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
