"""Where a real model's PPO iteration spends its time, against what this CPU can do: each pass of
the published SmolLM2 recipe (``bench/real/real_model.py``) timed, its FLOPs counted from the shapes
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

- generation: 2 N for each row computed at each step, prompt positions in the prefill, and
  2 V d for each row's next token (with ``model.generate`` every row runs until the longest
  ends; the sampling loop drops ended rows, and the rows it computes are counted);
- scoring: 2 N at every position of each chunk's ``[prompt; response]`` as padded, and 2 V d at
  its response positions (the output layer skips the prompt);
- update: 4 N with LoRA (forward, and the backward pass's products with the frozen weights to
  pass gradients down), 6 N with full weights or gradient checkpointing, 8 N with both, at every
  position of each trimmed micro-batch; 4 V d (6 V d with full weights) at its response positions.

Padding is the share of computed positions that hold no real token: left prompt padding,
response positions after a row's end, and in generation the steps a finished row still runs.
The work the iteration must do counts real tokens only, and no policy scoring pass when there
is no critic (the sampler can keep the old log-probabilities): that over the iteration's time is
the fraction of the peak that compares code versions.

``--against REV`` runs the same profile on the code of git revision ``REV`` first (a worktree
in a temporary folder; recipe keys that code does not know are left out and named), then on
this code, and prints both and their ratio: one invocation, one machine.

    .venv/bin/python -m bench.speed.iteration_profile                 # about 12 minutes on 2 CPU cores
    .venv/bin/python -m bench.speed.iteration_profile --against cfeec2e   # before and after, twice that
    .venv/bin/python -m bench.speed.iteration_profile --set train.gradient_checkpointing=true
    .venv/bin/python -m bench.speed.iteration_profile --smoke         # the tiny default, seconds
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
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
        self.scoring = "score_policy"
        self.decode_rows: list[int] = []  # rows computed at each draw of the sampling loop

    def wrap(self, module, name: str, label) -> None:
        original = getattr(module, name)

        def timed(*args, **kwargs):
            which = label(*args, **kwargs) if callable(label) else label
            if which in ("score_policy", "score_reference"):
                self.scoring = which
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
        if which == "draw":
            self.decode_rows.append(int(args[0].shape[0]))
        elif which == "generate":
            prompt_mask, response_mask = result.prompt_mask, result.response_mask
            rows, prompt_len = prompt_mask.shape
            steps = response_mask.shape[1]
            if self.decode_rows:  # the sampling loop: rows leave the batch as they end
                decoded, self.decode_rows = self.decode_rows, []
                block, output = rows * prompt_len + sum(decoded[1:]), sum(decoded)
            else:  # generate: every row runs every step
                block, output = rows * (prompt_len + steps), rows * steps
            self.add("generate", block, output, prompt_mask, response_mask)
        elif which == "scoring_chunk" or which == "micro_batch":
            prompt_ids, prompt_mask, response_ids, response_mask = args[1:5]
            rows = prompt_ids.shape[0]
            self.add(
                self.scoring if which == "scoring_chunk" else "update",
                rows * (prompt_ids.shape[1] + response_ids.shape[1]),
                rows * response_ids.shape[1],
                prompt_mask,
                response_mask,
            )

    def add(self, name, block_positions, output_positions, prompt_mask, response_mask) -> None:
        shapes = self.shapes[self.iteration][name]
        shapes["block_positions"] += block_positions
        shapes["output_positions"] += output_positions
        shapes["real_positions"] += float(prompt_mask.sum() + response_mask.sum())
        shapes["real_output_positions"] += float(response_mask.sum())


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


def newer_or_older(*names: str):
    """The first module of ``names`` that imports: the library's rooms were renamed, and
    ``--against`` may profile a revision from before (``ppo_core.training.loop`` was
    ``ppo_core.trainer``)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"none of {names} imports")


def install(timer: PassTimer) -> None:
    """Wrap the functions each pass runs through (module attributes, so the trainer's own
    calls go through the wrappers)."""
    ActorCritic = newer_or_older("ppo_core.models.policy", "ppo_core.modeling.policy").ActorCritic
    trainer = newer_or_older("ppo_core.training.loop", "ppo_core.trainer")
    rollout = newer_or_older("ppo_core.training.rollout", "ppo_core.rollout")
    update = newer_or_older("ppo_core.training.update", "ppo_core.update")
    timer.wrap(rollout, "sample_responses", "generate")
    timer.wrap(
        rollout,
        "score_in_chunks",
        lambda model, *a, **k: (
            "score_policy" if isinstance(model, ActorCritic) else "score_reference"
        ),
    )
    timer.wrap(rollout, "score_responses", "reward")
    # score_in_chunks calls score_sequences from the module that defines it
    experience = newer_or_older(
        "ppo_core.experience.sampling", "ppo_core.training.rollout", "ppo_core.rollout"
    )
    timer.wrap(experience, "score_sequences", lambda *a, **k: "scoring_chunk")
    timer.wrap(trainer, "ppo_update", "update")
    timer.wrap(update, "score_sequences", lambda *a, **k: "micro_batch")
    try:  # the sampling loop (code before it sampled with model.generate)
        sampling = newer_or_older("ppo_core.models.sampling", "ppo_core.modeling.sampling")
        timer.wrap(sampling, "_draw_next", lambda *a, **k: "draw")
    except ImportError:
        pass
    original_iteration = trainer.run_iteration

    def counted(config, runtime, inputs, models, state, *engine):  # the engine: today's code
        timer.iteration = state.iteration
        timer.profiling = state.iteration == config.train.iterations - 1
        return original_iteration(config, runtime, inputs, models, state, *engine)

    trainer.run_iteration = counted


def model_sizes(folder: str) -> dict[str, float]:
    """N (the blocks' weights) and V x d (the output layer) of the policy in ``folder``."""
    policy = newer_or_older("ppo_core.models.policy", "ppo_core.modeling.policy")
    model = policy.load_causal_lm(folder)
    total = sum(p.numel() for p in model.parameters())
    output = model.get_output_embeddings().weight.numel()
    blocks = total - output - (0 if model.config.tie_word_embeddings else output)
    return {"blocks": float(blocks), "output": float(output)}


def pass_flops(
    name: str, shapes: dict[str, float], sizes: dict[str, float], config, useful: bool = False
) -> float:
    """FLOPs of one pass from the positions it computed (module docstring); with ``useful``,
    from its real tokens alone, the work no padding adds."""
    if name == "reward" or not shapes:
        return 0.0
    blocks, output = sizes["blocks"], sizes["output"]
    block_positions = shapes["real_positions" if useful else "block_positions"]
    output_positions = shapes["real_output_positions" if useful else "output_positions"]
    if name != "update":
        return 2 * blocks * block_positions + 2 * output * output_positions
    lora, checkpointing = config.model.lora.enabled, config.train.gradient_checkpointing
    block_factor = (4 if lora else 6) + (2 if checkpointing else 0)
    output_factor = 4 if lora else 6
    return block_factor * blocks * block_positions + output_factor * output * output_positions


def main() -> None:
    from bench import common
    from bench.common import (
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
    parser.add_argument("--out", type=Path, help="default: bench/results/iteration_profile.json")
    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    parser.add_argument(
        "--against",
        metavar="REV",
        help="profile the code of this git revision first, then this code, and compare",
    )
    args = parser.parse_args()
    if args.against:
        results = (
            common.output_folder("iteration_profile") if args.smoke else ROOT / "bench" / "results"
        )
        args.out = args.out or results / "iteration_profile_against.json"
        compare(args)
        return
    overrides = [*TRAINING, f"threads={args.threads}"]
    if args.smoke:
        smoke = common.output_folder("iteration_profile")
        args.work = smoke / "project"
        args.out = args.out or smoke / "iteration_profile.json"
        args.warmup, args.iterations = 0, 1
        source = str(smoke_chat_model(smoke / "tiny"))
        overrides += SMOKE_TRAINING
    else:
        source = str(smollm2_gguf())
        args.out = args.out or ROOT / "bench" / "results" / "iteration_profile.json"
    total = args.warmup + args.iterations + 1
    overrides += [*args.set, f"train.iterations={total}", f"train.checkpoint_every={total}"]
    result = run(args, source, known_keys(overrides))
    result["matmul_peak_gflops_per_s"] = matmul_peak_gflops(args.threads)
    # under --against, this runs with the revision's bench and ppo_core first on the path: one
    # older than bench.common.machine has no block to give (the comparison's file carries this
    # code's)
    if hasattr(common, "machine"):
        result["machine"] = common.machine()
    summarise(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"results in {args.out}")


def known_keys(overrides: list[str]) -> list[str]:
    """The settings whose keys the code under test knows (an older revision lacks newer ones);
    the others are named and left out."""
    from omegaconf import OmegaConf

    from ppo_core.config import Config

    schema = OmegaConf.structured(Config)
    kept = []
    for setting in overrides:
        key = setting.split("=", 1)[0]
        if OmegaConf.select(schema, key, default="<missing>") == "<missing>":
            print(f"left out (this code has no key {key}): {setting}")
        else:
            kept.append(setting)
    return kept


def compare(args) -> None:
    """Profile revision ``args.against`` in a worktree, then this code, each in a process of
    its own with that code first on ``PYTHONPATH`` (this script, by its path, measures both;
    ``bench`` comes from the revision when it is a package there, else from this checkout);
    print both and their ratio."""
    import subprocess
    import sys
    import tempfile

    from bench import common

    options = [
        *(["--smoke"] if args.smoke else []),
        f"--warmup={args.warmup}",
        f"--iterations={args.iterations}",
        f"--threads={args.threads}",
        f"--work={args.work}",
        "--set",
        *args.set,
    ]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="profile-against-") as tmp:
        tree = Path(tmp) / "code"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", str(tree), args.against], check=True)
        try:
            for name, code in ((args.against, tree), ("this code", ROOT)):
                out = Path(tmp) / f"{len(runs)}.json"
                subprocess.run(
                    [sys.executable, __file__, *options, f"--out={out}"],
                    check=True,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join((str(code), str(ROOT)))},
                )
                runs[name] = json.loads(out.read_text())
        finally:
            subprocess.run([*git, "remove", "--force", str(tree)], check=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**runs, "machine": common.machine()}, indent=1))
    peak = runs["this code"]["matmul_peak_gflops_per_s"]
    print(f"\nside by side, one machine (fp32 matmul peak {peak:.0f} GFLOP/s), seconds:")
    print(f"{'pass':15}" + "".join(f"{name[:12]:>13}" for name in runs) + "   after/before")
    for name in (*PASSES, "iteration"):
        before, after = (run["median"][name]["seconds"] for run in runs.values())
        ratio = f"{after / before:9.2f}x" if before else "        -"
        print(f"{name:15}{before:13.2f}{after:13.2f}   {ratio}")
    useful = [run["median"]["iteration"]["useful_fraction_of_peak"] for run in runs.values()]
    print(f"{'must-do, of peak':15}" + "".join(f"{u:13.1%}" for u in useful))
    print(f"results in {args.out}")


def run(args, source: str, overrides: list[str]) -> dict:
    from bench import common
    from flows import stages

    config = common.start_chat_project(args.work, common.chat_prompts(560), source, overrides)
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
        # the work the iteration must do: its real tokens, and no policy pass without a critic
        # (the sampler can keep the old log-probabilities)
        row["useful_flops"] = sum(
            pass_flops(name, timer.shapes[index][name], sizes, config, useful=True)
            for name in PASSES
            if name != "score_policy" or config.model.critic != "none"
        )
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
    useful = statistics.median(r["useful_flops"] for r in rows)
    passes["iteration"] = {
        "seconds": iteration_s,
        "gflop": flops / 1e9,
        "fraction_of_peak": flops / iteration_s / peak,
        "padding": None,
        "other_seconds": iteration_s - sum(p["seconds"] for p in passes.values()),
        "useful_gflop": useful / 1e9,
        "useful_fraction_of_peak": useful / iteration_s / peak,
    }
    result["median"] = passes


def print_table(result: dict) -> None:
    print(f"fp32 matmul peak: {result['matmul_peak_gflops_per_s']:.0f} GFLOP/s")
    print("pass              s      GFLOP   of peak  padding")
    for name, row in result["median"].items():
        share = f"{row['fraction_of_peak']:7.1%}" if row["fraction_of_peak"] else "      -"
        padding = f"{row['padding']:7.1%}" if row["padding"] is not None else "      -"
        print(f"{name:15} {row['seconds']:6.2f} {row['gflop']:9.1f} {share}  {padding}")
    whole = result["median"]["iteration"]
    print(f"(not in a pass: {whole['other_seconds']:.2f} s)")
    print(
        f"the work the iteration must do (real tokens; no policy pass without a critic): "
        f"{whole['useful_gflop']:.1f} GFLOP, {whole['useful_fraction_of_peak']:.1%} of the peak"
    )
    for name, operators in result["top_operators"].items():
        shown = ", ".join(f"{o['operator']} {o['share']:.0%}" for o in operators[:5])
        print(f"top operators, {name}: {shown}")


if __name__ == "__main__":
    main()
