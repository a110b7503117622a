"""fp32 against bf16 autocast (``precision=bf16``) on this CPU: matrix products, the PPO update,
where the update's time goes, and what bf16 does to the exact micro-batch accumulation.

1. Matrix products, one thread: GFLOP/s of ``torch.mm`` in fp32 and bf16 for a 1024 cube and for
   the three products of one linear layer of the update (160 tokens, 896 -> 4864: forward, input
   gradient, weight gradient).
2. The update: ``ppo_update`` (one epoch, mini-batch 8, micro-batch 4, 24 prompt + 16 response
   tokens, AdamW) of a Qwen2-0.5B-shaped slice (hidden 896, intermediate 4864, 14 heads, 2
   key-value heads, ``--layers`` of its 24 layers, vocabulary 512) with a value head, in fp32
   and under bf16 autocast; seconds per update (mean of two after a warm-up) and, for bf16, the
   five operators with the most self time (``torch.profiler``).
3. Exactness: one SGD iteration of the tiny default (as ``tests/test_trainer.py`` runs it) with
   micro-batch 1 against micro-batch 8, in fp32 and in bf16: the largest relative difference of
   the parameters reached (``max_relative_difference``).

Writes ``bench/results/precision.json``.

    .venv/bin/python bench/precision.py [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars


def gflops(a: torch.Tensor, b: torch.Tensor, repeats: int = 3) -> float:
    torch.mm(a, b)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    seconds = (time.perf_counter() - started) / repeats
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / seconds / 1e9


def matmuls() -> dict:
    tokens, inner, outer = 160, 896, 4864
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(tokens, inner, dtype=dtype)
        w = torch.randn(outer, inner, dtype=dtype)
        grad = torch.randn(tokens, outer, dtype=dtype)
        cube = torch.randn(1024, 1024, dtype=dtype)
        rates[name] = {
            "cube_1024": gflops(cube, cube),
            "forward": gflops(x, w.t()),
            "input_gradient": gflops(grad, w),
            "weight_gradient": gflops(grad.t(), x),
        }
    return rates


def update_seconds(layers: int, precision: str, profile: bool) -> dict:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from ppo_core.config import PPOConfig
    from ppo_core.modeling.policy import ActorCritic
    from ppo_core.rollout import RolloutBatch
    from ppo_core.runtime import Runtime
    from ppo_core.update import ppo_update

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    model = ActorCritic(AutoModelForCausalLM.from_config(config), torch.nn.Linear(896, 1)).eval()
    rows, prompt, response = 8, 24, 16
    generator = torch.Generator().manual_seed(0)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    batch = RolloutBatch(
        prompt_ids=torch.randint(3, 500, (rows, prompt), generator=generator),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
        response_ids=torch.randint(3, 500, (rows, response), generator=generator),
        response_mask=torch.ones(rows, response, dtype=torch.bool),
        old_logprobs=-6 + 0.1 * noise(rows, response),
        ref_logprobs=-6 + 0.1 * noise(rows, response),
        old_values=noise(rows, response),
        scores=noise(rows),
        rewards=noise(rows, response),
        advantages=noise(rows, response),
        returns=noise(rows, response),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ppo = PPOConfig(rollout_batch_size=rows, mini_batch_size=rows, micro_batch_size=4, epochs=1)
    runtime = Runtime(precision=precision)

    def update() -> None:
        shuffle = torch.Generator().manual_seed(0)
        ppo_update(
            model, optimizer, batch, ppo=ppo, temperature=1.0, generator=shuffle, runtime=runtime
        )

    update()  # warm-up
    started = time.perf_counter()
    for _ in range(2):
        update()
    result: dict = {"seconds": (time.perf_counter() - started) / 2}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CPU]) as recorded:
            update()
        events = sorted(recorded.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        result["top_operators"] = [
            {"name": e.key, "calls": e.count, "share": e.self_cpu_time_total / total}
            for e in events[:5]
        ]
    return result


def micro_batch_differences() -> dict:
    from safetensors.torch import load_file

    from ppo_core.modeling.review_grammar import default_prompts
    from ppo_core.modeling.tiny_default import build_tiny_default
    from tests.test_trainer import max_relative_difference, parameters_after_one_sgd_iteration

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = build_tiny_default(
            folder / "base", seed=0, n_sentences=2000, steps=40, num_threads=1
        )
        prompts = default_prompts(160, seed=0)
        files = []
        for name, chunk in (("train", prompts[:128]), ("eval", prompts[128:])):
            path = folder / f"{name}.jsonl"
            path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in chunk))
            files.append(path)
        base = load_file(str(model / "model.safetensors"))
        for precision in ("fp32", "bf16"):
            reached = parameters_after_one_sgd_iteration(
                folder / precision, model, (files[0], files[1]), f"precision={precision}"
            )
            out[precision] = {
                "micro_1_vs_8": max_relative_difference(reached[1], reached[8]),
                "moved_from_base": max_relative_difference(
                    {k: v for k, v in reached[8].items() if k in base}, base
                ),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "precision.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    result = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "matmul_gflops": matmuls(),
        "update": {
            "layers": args.layers,
            "fp32": update_seconds(args.layers, "fp32", profile=False),
            "bf16": update_seconds(args.layers, "bf16", profile=True),
        },
        "micro_batch_invariance": micro_batch_differences(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
