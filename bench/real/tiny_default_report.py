"""Measure the embedded tiny default: build time and the quality of its samples before PPO.

Builds the default into a temporary folder, samples 2 continuations for each of 64 held-out
prompts (pure sampling: top_k=0, top_p=1, temperature 1, 16 new tokens, EOS stops) and prints
build seconds, mean VADER compound of prompt + response, fraction positive (> 0.05), EOS rate,
distinct-1/2 (over words of the responses) and a few samples; writes the numbers to
``bench/results/tiny_default_report.json``.

    .venv/bin/python -m bench.real.tiny_default_report [--seed 0]
    .venv/bin/python -m bench.real.tiny_default_report --smoke  # the smallest build, 4 prompts x 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

N_TRAIN_PROMPTS = 512  # default_prompts(512 + 64, seed)[:512] is left to PPO training
N_HELD_OUT = 64
SAMPLES_PER_PROMPT = 2
MAX_NEW_TOKENS = 16


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-grams / all n-grams over the whitespace words of ``texts`` (pooled)."""
    grams = [tuple(w[i : i + n]) for w in (t.split() for t in texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "tiny_default_report.json"
    )
    from bench import common

    parser.add_argument(
        "--smoke", action="store_true", help=f"{common.HELP} (the build: common.tiny_model)"
    )
    args = parser.parse_args()
    held_out, samples_per_prompt, max_new_tokens = N_HELD_OUT, SAMPLES_PER_PROMPT, MAX_NEW_TOKENS
    if args.smoke:
        held_out, samples_per_prompt, max_new_tokens = 4, 1, 4
        args.out = common.output_folder("tiny_default_report") / "tiny_default_report.json"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_core.base_sources.review_grammar import default_prompts
    from ppo_core.base_sources.tiny_default import build_tiny_default
    from ppo_core.rewards.scorers import SentimentScorer

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        if args.smoke:
            path = common.tiny_model(Path(tmp) / "tiny", seed=args.seed)
        else:
            path = build_tiny_default(f"{tmp}/tiny", seed=args.seed)
        build_s = time.perf_counter() - start
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)

    prompts = default_prompts(N_TRAIN_PROMPTS + held_out, args.seed)[N_TRAIN_PROMPTS:]
    prompts = [p for p in prompts for _ in range(samples_per_prompt)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)  # bos-prefixed, left-padded
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=max_new_tokens,
        )
    gen_s = time.perf_counter() - start
    response_ids = out[:, batch["input_ids"].shape[1] :]
    eos = tokenizer.eos_token_id
    ended = (response_ids == eos).any(dim=1)
    responses = []
    for row in response_ids.tolist():
        row = row[: row.index(eos)] if eos in row else row  # decode only up to the first EOS
        responses.append(tokenizer.decode(row, skip_special_tokens=True))
    scores = SentimentScorer()(prompts, responses)

    report = {
        "build_s": build_s,
        "generate_s": gen_s,
        "samples": len(prompts),
        "mean_vader_compound": scores.mean().item(),
        "fraction_positive": (scores > 0.05).float().mean().item(),
        "fraction_negative": (scores < -0.05).float().mean().item(),
        "eos_rate": ended.float().mean().item(),
        "distinct_1": distinct_n(responses, 1),
        "distinct_2": distinct_n(responses, 2),
        "machine": common.machine(),
    }
    show(report, prompts, responses, scores)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


def show(report: dict, prompts: list[str], responses: list[str], scores) -> None:
    """The report as lines, and five of the samples with their scores."""
    build_s, gen_s = report["build_s"], report["generate_s"]
    print(f"build seconds        {build_s:.1f}")
    print(f"generate seconds     {gen_s:.2f} ({len(prompts)} samples)")
    print(f"mean VADER compound  {report['mean_vader_compound']:+.3f}")
    print(f"fraction positive    {report['fraction_positive']:.3f}")
    print(f"fraction negative    {report['fraction_negative']:.3f}")
    print(f"EOS rate             {report['eos_rate']:.3f}")
    print(f"distinct-1           {report['distinct_1']:.3f}")
    print(f"distinct-2           {report['distinct_2']:.3f}")
    print("samples:")
    for i in range(0, len(prompts), max(1, len(prompts) // 5))[:5]:
        print(f"  [{scores[i].item():+.2f}] {prompts[i]!r} + {responses[i]!r}")


if __name__ == "__main__":
    main()
