"""Measure the embedded tiny default: build time and the quality of its samples before PPO.

Builds the default into a temporary folder, samples 2 continuations for each of 64 held-out
prompts (pure sampling: top_k=0, top_p=1, temperature 1, 16 new tokens, EOS stops) and prints
build seconds, mean VADER compound of prompt + response, fraction positive (> 0.05), EOS rate,
distinct-1/2 (over words of the responses) and a few samples.

    .venv/bin/python bench/tiny_default_report.py [--seed 0]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

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
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_core.modeling.review_grammar import default_prompts
    from ppo_core.modeling.rewards import SentimentScorer
    from ppo_core.modeling.tiny_default import build_tiny_default

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = build_tiny_default(f"{tmp}/tiny", seed=args.seed)
        build_s = time.perf_counter() - start
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)

    prompts = default_prompts(N_TRAIN_PROMPTS + N_HELD_OUT, args.seed)[N_TRAIN_PROMPTS:]
    prompts = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
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
            max_new_tokens=MAX_NEW_TOKENS,
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

    print(f"build seconds        {build_s:.1f}")
    print(f"generate seconds     {gen_s:.2f} ({len(prompts)} samples)")
    print(f"mean VADER compound  {scores.mean().item():+.3f}")
    print(f"fraction positive    {(scores > 0.05).float().mean().item():.3f}")
    print(f"fraction negative    {(scores < -0.05).float().mean().item():.3f}")
    print(f"EOS rate             {ended.float().mean().item():.3f}")
    print(f"distinct-1           {distinct_n(responses, 1):.3f}")
    print(f"distinct-2           {distinct_n(responses, 2):.3f}")
    print("samples:")
    for i in range(0, len(prompts), len(prompts) // 5)[:5]:
        print(f"  [{scores[i].item():+.2f}] {prompts[i]!r} + {responses[i]!r}")


if __name__ == "__main__":
    main()
