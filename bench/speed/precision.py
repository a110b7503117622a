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
3. Exactness: one SGD iteration of the tiny default (the run of the trainer's micro-batch test:
   rollout 16, mini-batch 8, 2 epochs, 6 new tokens, SGD at 0.5, no clipping) with micro-batch 1
   against micro-batch 8, in fp32 and in bf16: the largest relative difference of the
   parameters reached (:func:`max_relative_difference`).

Writes ``bench/results/precision.json``.

    .venv/bin/python -m bench.speed.precision [--layers 2]
    .venv/bin/python -m bench.speed.precision --smoke   # the shapes of SMOKE, to a temporary folder
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars

QWEN2_SLICE = dict(
    hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2
)
"""The update's model: a Qwen2-0.5B layer shape (``--layers`` of them)."""
MATMUL_SHAPE = dict(tokens=160, inner=896, outer=4864, cube=1024)
"""The products timed: one linear layer of the update, and a square matrix."""
SMOKE = dict(
    slice=dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1),
    matmul=dict(tokens=16, inner=64, outer=128, cube=128),
)
"""``--smoke``: one layer of width 64, small products; the exactness runs on a one-layer model
built on the spot (``common.tiny_model``)."""


def gflops(a: torch.Tensor, b: torch.Tensor, repeats: int = 3) -> float:
    torch.mm(a, b)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    seconds = (time.perf_counter() - started) / repeats
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / seconds / 1e9


def matmuls(tokens: int, inner: int, outer: int, cube: int) -> dict:
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(tokens, inner, dtype=dtype)
        w = torch.randn(outer, inner, dtype=dtype)
        grad = torch.randn(tokens, outer, dtype=dtype)
        square = torch.randn(cube, cube, dtype=dtype)
        rates[name] = {
            f"cube_{cube}": gflops(square, square),
            "forward": gflops(x, w.t()),
            "input_gradient": gflops(grad, w),
            "weight_gradient": gflops(grad.t(), x),
        }
    return rates


def update_seconds(layers: int, precision: str, profile: bool, shape: dict[str, int]) -> dict:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from ppo_core.config import PPOConfig
    from ppo_core.models.policy import ActorCritic
    from ppo_core.parallel.runtime import Runtime
    from ppo_core.training.batch import RolloutBatch
    from ppo_core.training.update import ppo_update

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        num_hidden_layers=layers,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        **shape,
    )
    head = torch.nn.Linear(shape["hidden_size"], 1)
    model = ActorCritic(AutoModelForCausalLM.from_config(config), head).eval()
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


def parameters(folder: Path) -> dict[str, torch.Tensor]:
    """The policy's weights in a candidate folder, and its value head's where it has one."""
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    head = folder / "value_head.safetensors"
    if head.is_file():
        weights.update({f"value_head.{k}": v for k, v in load_file(str(head)).items()})
    return weights


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ``max |a - b| / max |b|`` over the tensors of two state dicts (same keys)."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in a)


def after_one_sgd_iteration(
    work: Path, model: Path, files: tuple[Path, Path], micro: int, precision: str
) -> dict[str, torch.Tensor]:
    """The parameters after one PPO iteration with plain SGD and no clipping, so that the
    parameters move by the gradient alone, at micro-batch size ``micro``."""
    from ppo_core.config import load_config
    from ppo_core.training.loop import train

    train(
        load_config(
            overrides=[
                f"model.policy={model}",
                f"data.train_file={files[0]}",
                f"data.eval_file={files[1]}",
                f"train.output_dir={work / 'candidate'}",
                f"train.checkpoint_dir={work / 'checkpoints'}",
                f"train.metrics_dir={work / 'metrics'}",
                "train.iterations=1",
                "train.checkpoint_every=1",
                "ppo.rollout_batch_size=16",
                "ppo.mini_batch_size=8",
                f"ppo.micro_batch_size={micro}",
                "ppo.epochs=2",
                "ppo.max_grad_norm=null",
                "generation.max_new_tokens=6",
                "optim.name=sgd",
                "optim.lr=0.5",
                f"precision={precision}",
            ]
        )
    )
    return parameters(work / "candidate")


def micro_batch_differences(smoke: bool) -> dict:
    from ppo_core.base_sources.review_grammar import default_prompts
    from ppo_core.base_sources.tiny_default import build_tiny_default

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if smoke:
            from bench import common

            model = common.tiny_model(folder / "base")
        else:
            model = build_tiny_default(
                folder / "base", seed=0, n_sentences=2000, steps=40, num_threads=1
            )
        prompts = default_prompts(160, seed=0)
        files = []
        for name, chunk in (("train", prompts[:128]), ("eval", prompts[128:])):
            path = folder / f"{name}.jsonl"
            path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in chunk))
            files.append(path)
        base = parameters(model)
        for precision in ("fp32", "bf16"):
            reached = {
                micro: after_one_sgd_iteration(
                    folder / f"{precision}-micro{micro}",
                    model,
                    (files[0], files[1]),
                    micro,
                    precision,
                )
                for micro in (1, 8)
            }
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
    from bench import common

    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    shape, matmul = QWEN2_SLICE, MATMUL_SHAPE
    if args.smoke:
        args.layers, shape, matmul = 1, SMOKE["slice"], SMOKE["matmul"]
        args.out = str(common.output_folder("precision") / "precision.json")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    result = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "matmul_gflops": matmuls(**matmul),
        "update": {
            "layers": args.layers,
            "shape": shape,
            "fp32": update_seconds(args.layers, "fp32", profile=False, shape=shape),
            "bf16": update_seconds(args.layers, "bf16", profile=True, shape=shape),
        },
        "micro_batch_invariance": micro_batch_differences(args.smoke),
        "machine": common.machine(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
