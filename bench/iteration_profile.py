"""Where a real model's PPO iteration spends its time, against what this CPU can do: each pass of
the published SmolLM2 recipe (``bench/real_model.py``) timed, its FLOPs counted from the shapes
it ran, its fraction of the measured fp32 matmul peak, the share of its tokens that are padding,
and its top operators from ``torch.profiler``.

The run is the pipeline's own: ``base`` imports SmolLM2-135M-Instruct from its GGUF file,
``prepare`` and ``validate`` make a data version of film-review chats, and ``ppo_core``'s
trainer runs ``--warmup`` + ``--iterations`` + 1 iterations of the recipe. The passes are timed
by wrapping the functions the trainer calls (the real functions run, unchanged): generation
(``rollout.sample_responses``), the policy's and the reference's scoring passes
(``rollout.score_in_chunks``), the reward, and the update (``trainer.ppo_update``, whose
micro-batches' shapes come from ``update.score_sequences``). The warm-up iterations are left
out; the medians of the measured ones are reported; the last iteration runs under the profiler
(its times are not used).

FLOPs per token (N: the weights of the transformer blocks; V x d: the output layer; attention
scores and LoRA's own products left out, a few percent at these lengths):

- generation: 2 N for each row at each step, prompt positions in the prefill, and 2 V d for
  each row's next token; a row that has ended still computes until the longest ends;
- scoring: 2 N at every position of ``[prompt; response]`` as padded for the whole batch, and
  2 V d at the response positions (the output layer skips the prompt);
- update: 4 N with LoRA (forward, and the backward pass's products with the frozen weights to
  pass gradients down), 6 N with full weights or gradient checkpointing, 8 N with both, at every
  position of each trimmed micro-batch; 4 V d (6 V d with full weights) at its response positions.

Padding is the share of computed positions that hold no real token: left prompt padding,
response positions after a row's end, and in generation the steps a finished row still runs.

    .venv/bin/python bench/iteration_profile.py                 # about 7 minutes on 2 CPU cores
    .venv/bin/python bench/iteration_profile.py --set train.gradient_checkpointing=true
    .venv/bin/python bench/iteration_profile.py --smoke         # the tiny default, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PASSES = ("generate", "score_policy", "score_reference", "reward", "update")


class PassTimer:
    """Wraps the trainer's functions to time each pass and record the shapes it ran."""

    def __init__(self) -> None:
        self.iteration = 0
        self.profiling = False
        self.seconds: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.shapes: dict[int, dict[str, dict[str, float]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(float))
        )
        self.top_operators: dict[str, list[dict]] = {}

    def wrap(self, module, name: str, label) -> None:
        original = getattr(module, name)

        def timed(*args, **kwargs):
            which = label(*args, **kwargs) if callable(label) else label
            profiler = None
            if self.profiling and which in PASSES and which not in self.top_operators:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
            started = time.perf_counter()
            result = original(*args, **kwargs)
            if which is not None:
                self.seconds[self.iteration][which] += time.perf_counter() - started
            if profiler is not None:
                profiler.__exit__(None, None, None)
                self.top_operators[which] = top_operators(profiler)
            self.observe(which, args, kwargs, result)
            return result

        setattr(module, name, timed)

    def observe(self, which, args, kwargs, result) -> None:
        shapes = self.shapes[self.iteration]
        if which == "generate":
            prompt_mask, response_mask = result.prompt_mask, result.response_mask
            rows, prompt_len = prompt_mask.shape
            steps = response_mask.shape[1]
            shapes["generate"]["block_positions"] += rows * (prompt_len + steps)
            shapes["generate"]["output_positions"] += rows * steps
            shapes["generate"]["real_positions"] += float(prompt_mask.sum() + response_mask.sum())
        elif which in ("score_policy", "score_reference"):
            generated = args[1]
            rows, prompt_len = generated.prompt_mask.shape
            length = generated.response_mask.shape[1]
            shapes[which]["block_positions"] += rows * (prompt_len + length)
            shapes[which]["output_positions"] += rows * length
            shapes[which]["real_positions"] += float(
                generated.prompt_mask.sum() + generated.response_mask.sum()
            )
        elif which == "micro_batch":
            prompt_ids, prompt_mask, response_ids, response_mask = args[1:5]
            rows = prompt_ids.shape[0]
            shapes["update"]["block_positions"] += rows * (
                prompt_ids.shape[1] + response_ids.shape[1]
            )
            shapes["update"]["output_positions"] += rows * response_ids.shape[1]
            shapes["update"]["real_positions"] += float(prompt_mask.sum() + response_mask.sum())


def top_operators(profiler, count: int = 8) -> list[dict]:
    """The ``count`` operators with the most self CPU time, each with its share of the pass."""
    averages = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in averages) or 1.0
    ranked = sorted(averages, key=lambda event: event.self_cpu_time_total, reverse=True)
    return [
        {
            "operator": event.key,
            "self_s": event.self_cpu_time_total / 1e6,
            "share": event.self_cpu_time_total / total,
            "calls": event.count,
        }
        for event in ranked[:count]
    ]


def install(timer: PassTimer) -> None:
    """Wrap the functions each pass runs through (module attributes, so the trainer's own
    calls go through the wrappers)."""
    from ppo_core import rollout, trainer, update
    from ppo_core.modeling.policy import ActorCritic

    timer.wrap(rollout, "sample_responses", "generate")
    timer.wrap(
        rollout,
        "score_in_chunks",
        lambda model, *a, **k: (
            "score_policy" if isinstance(model, ActorCritic) else "score_reference"
        ),
    )
    timer.wrap(rollout, "score_responses", "reward")
    timer.wrap(trainer, "ppo_update", "update")
    timer.wrap(update, "score_sequences", lambda *a, **k: "micro_batch")
    original_iteration = trainer.run_iteration

    def counted(config, runtime, inputs, models, state):
        timer.iteration = state.iteration
        timer.profiling = state.iteration == config.train.iterations - 1
        return original_iteration(config, runtime, inputs, models, state)

    trainer.run_iteration = counted


def model_sizes(folder: str) -> dict[str, float]:
    """N (the blocks' weights) and V x d (the output layer) of the policy in ``folder``."""
    from ppo_core.modeling.policy import load_causal_lm

    model = load_causal_lm(folder)
    total = sum(p.numel() for p in model.parameters())
    output = model.get_output_embeddings().weight.numel()
    blocks = total - output - (0 if model.config.tie_word_embeddings else output)
    return {"blocks": float(blocks), "output": float(output)}


def pass_flops(name: str, shapes: dict[str, float], sizes: dict[str, float], config) -> float:
    """FLOPs of one pass from the positions it computed (module docstring)."""
    if name == "reward":
        return 0.0
    blocks, output = sizes["blocks"], sizes["output"]
    if name != "update":
        return 2 * blocks * shapes["block_positions"] + 2 * output * shapes["output_positions"]
    lora, checkpointing = config.model.lora.enabled, config.train.gradient_checkpointing
    block_factor = (4 if lora else 6) + (2 if checkpointing else 0)
    output_factor = 4 if lora else 6
    return (
        block_factor * blocks * shapes["block_positions"]
        + output_factor * output * shapes["output_positions"]
    )


def main() -> None:
    import _smoke
    from real_model import (
        SMOKE_TRAINING,
        TRAINING,
        matmul_peak_gflops,
        smoke_chat_model,
        smollm2_gguf,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ppo-iteration-profile"))
    parser.add_argument("--warmup", type=int, default=1, help="iterations left out first")
    parser.add_argument("--iterations", type=int, default=3, help="iterations measured")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value settings")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "iteration_profile.json"
    )
    parser.add_argument("--smoke", action="store_true", help=_smoke.HELP)
    args = parser.parse_args()
    overrides = [*TRAINING, f"threads={args.threads}"]
    if args.smoke:
        smoke = _smoke.output_folder("iteration_profile")
        args.work, args.out = smoke / "project", smoke / "iteration_profile.json"
        args.warmup, args.iterations = 0, 1
        source = str(smoke_chat_model(smoke / "tiny"))
        overrides += SMOKE_TRAINING
    else:
        source = str(smollm2_gguf())
    total = args.warmup + args.iterations + 1
    overrides += [*args.set, f"train.iterations={total}", f"train.checkpoint_every={total}"]
    result = run(args, source, overrides)
    result["matmul_peak_gflops_per_s"] = matmul_peak_gflops(args.threads)
    summarise(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"results in {args.out}")


def run(args, source: str, overrides: list[str]) -> dict:
    from real_model import chat_prompts

    from flows import stages
    from ppo_core.config import load_config

    if args.work.exists():
        shutil.rmtree(args.work)
    (args.work / "data" / "raw").mkdir(parents=True)
    os.chdir(args.work)
    rows = chat_prompts(560)
    (args.work / "data" / "raw" / "chats.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows)
    )
    config = load_config(overrides=[f"base.source={source}", *overrides])
    stages.base(config)
    stages.prepare(config)
    stages.validate(config)
    timer = PassTimer()
    install(timer)
    summary = stages.train(config, show_progress=True)
    sizes = model_sizes(config.model.policy)
    measured = range(args.warmup, args.warmup + args.iterations)
    per_iteration = []
    for index in measured:
        row = {"iteration": index + 1, "seconds": dict(timer.seconds[index])}
        row["iteration_s"] = float(summary.history[index]["perf/iteration_s"])
        row["flops"] = {
            name: pass_flops(name, timer.shapes[index][name], sizes, config) for name in PASSES
        }
        row["padding"] = {
            name: 1 - shapes["real_positions"] / shapes["block_positions"]
            for name, shapes in timer.shapes[index].items()
            if shapes["block_positions"]
        }
        per_iteration.append(row)
    return {
        "model": "SmolLM2-135M-Instruct + LoRA" if not args.smoke else "tiny default (smoke)",
        "threads": args.threads,
        "sizes": sizes,
        "iterations": per_iteration,
        "top_operators": timer.top_operators,
        "settings": overrides,
    }


def summarise(result: dict) -> None:
    """Medians over the measured iterations, per pass: seconds, GFLOP, fraction of the peak and
    padding; and the iteration's whole FLOPs against its time."""
    peak = result["matmul_peak_gflops_per_s"] * 1e9
    rows = result["iterations"]
    passes = {}
    for name in PASSES:
        seconds = statistics.median(r["seconds"].get(name, 0.0) for r in rows)
        flops = statistics.median(r["flops"][name] for r in rows)
        padding = [r["padding"][name] for r in rows if name in r["padding"]]
        passes[name] = {
            "seconds": seconds,
            "gflop": flops / 1e9,
            "fraction_of_peak": flops / seconds / peak if seconds and flops else None,
            "padding": statistics.median(padding) if padding else None,
        }
    iteration_s = statistics.median(r["iteration_s"] for r in rows)
    flops = statistics.median(sum(r["flops"].values()) for r in rows)
    passes["iteration"] = {
        "seconds": iteration_s,
        "gflop": flops / 1e9,
        "fraction_of_peak": flops / iteration_s / peak,
        "padding": None,
        "other_seconds": iteration_s - sum(p["seconds"] for p in passes.values()),
    }
    result["median"] = passes


def print_table(result: dict) -> None:
    print(f"fp32 matmul peak: {result['matmul_peak_gflops_per_s']:.0f} GFLOP/s")
    print("pass              s      GFLOP   of peak  padding")
    for name, row in result["median"].items():
        share = f"{row['fraction_of_peak']:7.1%}" if row["fraction_of_peak"] else "      -"
        padding = f"{row['padding']:7.1%}" if row["padding"] is not None else "      -"
        print(f"{name:15} {row['seconds']:6.2f} {row['gflop']:9.1f} {share}  {padding}")
    print(f"(not in a pass: {result['median']['iteration']['other_seconds']:.2f} s)")
    for name, operators in result["top_operators"].items():
        shown = ", ".join(f"{o['operator']} {o['share']:.0%}" for o in operators[:5])
        print(f"top operators, {name}: {shown}")


if __name__ == "__main__":
    main()
