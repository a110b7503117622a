"""Rollout generation throughput: ``generate_responses`` vs a plain ``model.generate`` call.

Same model, prompts, batch, sampling (temperature 1, no top-k, no top-p) and seed; counts the
response tokens up to and including the first EOS. Medians over ``--repeats`` timed calls after
one warm-up. Writes ``bench/results/generation.json``.

    .venv/bin/python -m bench.speed.generation --model models/base [--batch 64] [--new-tokens 16]
    .venv/bin/python -m bench.speed.generation --smoke   # a one-layer model built on the spot
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "base"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "generation.json")
    from bench import common

    parser.add_argument(
        "--smoke", action="store_true", help=f"{common.HELP} (the model: common.tiny_model)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="generation-") as tmp:
        if args.smoke:
            args.batch, args.new_tokens, args.repeats = 4, 4, 1
            args.out = common.output_folder("generation") / "generation.json"
            args.model = str(common.tiny_model(Path(tmp) / "model"))
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """Time both sides on ``args.model`` and write ``args.out``."""
    from transformers import GenerationConfig

    from bench import common
    from ppo_core.base_sources.review_grammar import default_prompts
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.generation import generate_responses, response_mask_from_ids
    from ppo_core.models.policy import load_causal_lm

    model = load_causal_lm(args.model)
    tokenizer = load_tokenizer(args.model)
    prompts = default_prompts(args.batch, seed=0)
    plain_config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=1.0,
        max_new_tokens=args.new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    def plain() -> int:
        encoded = tokenizer(prompts, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**encoded, generation_config=plain_config)
        mask, _ = response_mask_from_ids(
            out[:, encoded["input_ids"].shape[1] :], tokenizer.eos_token_id
        )
        return int(mask.sum())

    def ours() -> int:
        return int(
            generate_responses(model, tokenizer, prompts, args.new_tokens).response_mask.sum()
        )

    results = {}
    for name, call in (("plain generate", plain), ("generate_responses", ours)):
        torch.manual_seed(0)
        call()
        rates = []
        for repeat in range(args.repeats):
            torch.manual_seed(repeat)
            start = time.perf_counter()
            tokens = call()
            rates.append(tokens / (time.perf_counter() - start))
        results[name] = statistics.median(rates)
        print(f"{name:>20}: {results[name]:8.0f} response tokens / s")
    ratio = results["generate_responses"] / results["plain generate"]
    print(f"ratio: {ratio:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "tokens_per_s": results,
                "ratio": ratio,
                "settings": {k: str(v) for k, v in vars(args).items()},
                "machine": common.machine(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
