"""The sampling loop with and without the few-row layouts (``ppo_core/models/few_rows.py``):
tokens per second at the recipe's row counts, the layout each shape took, and what the other
summation order changes.

Each side samples the same film-review chats with the pipeline's loop
(``ppo_core.models.sampling.sample_tokens``, temperature 1, no stop token, so every row runs
``--new-tokens`` steps) from the same seed: ``F.linear`` for every product (the layouts off), and
the layouts measured for this machine (the table is measured first, outside the timing, into a
temporary cache folder). Medians over ``--repeats`` calls after one warm-up, the sides
interleaved. The tokens of the two sides are compared, and the largest difference of a sampled
token's log-probability. Writes ``bench/results/few_rows.json``.

    .venv/bin/python -m bench.speed.few_rows                 # SmolLM2-135M-Instruct (GGUF import)
    .venv/bin/python -m bench.speed.few_rows --rows 8 32 --new-tokens 64
    .venv/bin/python -m bench.speed.few_rows --smoke         # a 1-layer, 256-wide Llama
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from bench import common

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: SmolLM2 imported from GGUF)")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "few_rows.json")
    parser.add_argument("--smoke", action="store_true", help=f"{common.HELP} (a 256-wide Llama)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="few-rows-") as tmp:
        os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")  # measured afresh
        if args.smoke:
            args.rows, args.new_tokens, args.repeats = [2], 4, 1
            args.out = common.output_folder("few_rows") / "few_rows.json"
            model = wide_llama()
        else:
            from bench.speed.lora_sampling import import_smollm2
            from ppo_core.models.policy import load_causal_lm

            folder = args.model or import_smollm2(Path(tmp) / "smollm2")
            model = load_causal_lm(folder).eval()
        measure(args, model)


def wide_llama():
    """A 1-layer Llama 256 wide (the narrowest the layouts touch), random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def sample(model, ids, new_tokens: int, layouts: bool, seed: int):
    """One call of the loop from ``seed``; with ``layouts`` off every product is ``F.linear``."""
    import contextlib

    from ppo_core.models.few_rows import few_row_products
    from ppo_core.models.sampling import sample_tokens

    torch.manual_seed(seed)
    with few_row_products(model) if layouts else contextlib.nullcontext():
        return sample_tokens(
            model,
            ids,
            torch.ones_like(ids),
            max_new_tokens=new_tokens,
            stop_ids=[-1],  # no row stops: every side computes the same steps
            pad_token_id=0,
        )


def measure(args: argparse.Namespace, model) -> None:
    from bench import common
    from ppo_core.models import few_rows

    rows_out = []
    for rows in args.rows:
        ids = torch.randint(3, model.config.vocab_size, (rows, 24), generator=torch.Generator())
        sample(model, ids, args.new_tokens, True, 0)  # measures this row count's shapes
        times: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(args.repeats + 1):
            for layouts in (False, True):
                started = time.perf_counter()
                sample(model, ids, args.new_tokens, layouts, repeat)
                if repeat:  # the first round warms up
                    times[layouts].append(time.perf_counter() - started)
        (plain_ids, plain_lp, _), (ids_on, lp_on, _) = (
            sample(model, ids, args.new_tokens, layouts, 0) for layouts in (False, True)
        )
        tokens = rows * args.new_tokens
        row = {
            "rows": rows,
            "new_tokens": args.new_tokens,
            "tokens_per_s_linear": tokens / statistics.median(times[False]),
            "tokens_per_s_layouts": tokens / statistics.median(times[True]),
            "same_tokens": bool(torch.equal(plain_ids, ids_on)),
            "max_logprob_difference": float((plain_lp - lp_on).abs().max()),
        }
        row["speedup"] = row["tokens_per_s_layouts"] / row["tokens_per_s_linear"]
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "rows": rows_out,
        "layouts": dict(sorted(few_rows._TABLE.items())),
        "threads": args.threads,
        "machine": common.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
