"""Peak memory and time of one PPO iteration as a Llama-style model grows, for full fine-tuning,
LoRA and LoRA with gradient checkpointing, on the CPU in fp32.

Models: random-weight ``LlamaConfig`` models (``AutoModelForCausalLM.from_config``, default
initialisation, seed 0) of about 20M, 100M and 350M parameters (shapes in ``SIZES``; head size 64,
as many key-value heads as query heads), with a byte-level BPE tokenizer of 512 tokens trained on
the review grammar (``train_tokenizer(generate_review_corpus(500, seed=0), vocab_size=512)``),
saved with ``save_pretrained`` to a temporary folder that the three modes share.

Modes:

- ``full``: full fine-tuning (the default config; the KL reference is a second, frozen fp32 copy
  of the policy);
- ``lora``: ``model.lora.enabled=true`` (rank 8, every linear layer of the trunk; the reference is
  the policy's own weights with the adapter off, no parameters of its own);
- ``lora+ckpt``: LoRA plus ``train.gradient_checkpointing=true``.

Each (size, mode) runs one PPO iteration, ``ppo_core.training.loop.train``, in a fresh child process:
rollout batch 8, mini-batch 8, micro-batch 4, 1 epoch, 16 new tokens, 1 thread, ``device=cpu``,
a checkpoint and the final candidate written to a temporary folder, and a reward that varies over
random text (:func:`varied_reward`) so that the update is not zero. Reported per run:

- ``params``: N, every parameter of the base model (embeddings and LM head included);
- ``peak_gib``: the child's peak resident set (``ru_maxrss``, read at its end), so it includes
  the interpreter, torch and the libraries (the intercept ``a`` of the fit below), model loading,
  the rollout, the update and the writing of the checkpoint and the candidate;
- ``bytes_per_param``: peak / N;
- ``reference_share``: the KL reference's own parameter bytes (full: 4 N, LoRA: 0) / peak;
- ``rollout_s``, ``update_s``: the metrics ``perf/rollout_s`` and ``perf/update_s`` of iteration 1;
- ``update_gflops``: the update's useful FLOPs per second of ``perf/update_s``, and
  ``update_peak_fraction``, that rate over the measured fp32 matrix-multiply peak.

Update FLOPs: with T the tokens in the update's forward passes, forward 2 N T, backward 4 N T for
full fine-tuning and 2 N T for LoRA (input gradients only: the frozen weights get none); gradient
checkpointing computes each forward once more (2 N T), which is counted in ``update_flops_done``
but not in the useful FLOPs the rate is reported with. T is approximated as ``rollout_batch_size
x epochs x (mean prompt tokens + rollout/response_length)``: the mean prompt length (BOS included)
is taken over the whole prompt file, not the prompts the iteration drew, and the padding of
prompts and responses to the longest one of a micro-batch, which the passes also compute, is not
counted; nor are attention scores, the value head, the optimizer step, and 2 N counts the
embedding lookup as if it were a matrix product (small at this vocabulary). The peak is measured
in a child with one thread: the median GFLOP/s of ``torch.mm`` of two 1024 x 1024 fp32 matrices
(2 x 1024^3 FLOPs each).

"Largest size each mode can run on a 24 GiB machine": the peaks of each mode over the sizes run
are fitted as ``peak = a + b N`` (least squares) and ``N_max = (24 GiB - a) / b`` is reported. It
is an extrapolation of three points (rollout 8, micro-batch 4, 16 new tokens), not a measurement.

``--qwen2`` (on by default) adds one iteration of a Qwen2-0.5B-shaped model (``Qwen2Config``: 24
layers, hidden 896, intermediate 4864, 14 heads, 2 key-value heads, tied embeddings, the small
tokenizer's vocabulary) with ``lora+ckpt``, under the same settings.

Writes ``bench/results/memory_scaling.json`` (or ``--out``) and prints markdown tables; progress
goes to stderr. The full measurement, then a small check (20M only, no Qwen2, results in /tmp):

    .venv/bin/python -m bench.speed.memory_scaling
    .venv/bin/python -m bench.speed.memory_scaling --sizes 20M --no-qwen2 --out /tmp/ms.json
    .venv/bin/python -m bench.speed.memory_scaling --smoke   # seconds: see SMOKE_SHAPE
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
MACHINE_GIB = 24

# Llama shapes: (hidden, intermediate, layers, heads), head size 64, no grouped-query attention.
SIZES: dict[str, dict[str, int]] = {
    "20M": dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8
    ),
    "100M": dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=14, num_attention_heads=12
    ),
    "350M": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=27, num_attention_heads=16
    ),
}
QWEN2_SHAPE: dict[str, object] = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
SMOKE_SHAPE: dict[str, int] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1
)
"""``--smoke``: a two-layer Llama of width 64 (about 0.1M parameters), ``lora+ckpt`` only (the
mode that uses the most of the trainer: adapters and gradient checkpointing), no Qwen2."""
LORA = ["model.lora.enabled=true", "model.lora.rank=8", "model.lora.target_modules=[all-linear]"]
MODES: dict[str, list[str]] = {
    "full": [],
    "lora": LORA,
    "lora+ckpt": [*LORA, "train.gradient_checkpointing=true"],
}
ROLLOUT, MINI, MICRO, EPOCHS, NEW_TOKENS = 8, 8, 4, 1, 16


def varied_reward(prompts: list, responses: list[str]):
    """A score that varies over random text, so that the advantages, and the update, are not
    zero (the built-in sentiment scores random-weight models' text 0 almost everywhere)."""
    import torch

    return torch.tensor([(sum(map(ord, r)) % 11) / 10.0 for r in responses])


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def build_child(family: str, shape: dict, folder: str, prompt_file: str) -> dict:
    """Save a random-weight model of ``family`` and ``shape`` with the small tokenizer to
    ``folder``; return its parameter count, its LoRA parameter count (rank 8, every linear layer
    but the LM head) and the mean token count of the prompts in ``prompt_file``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from ppo_core.base_sources.review_grammar import generate_review_corpus
    from ppo_core.base_sources.tiny_default import train_tokenizer
    from ppo_core.models.generation import prompt_token_ids

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = train_tokenizer(generate_review_corpus(500, seed=0), vocab_size=512)
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    config = config_class(
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    lora_params = sum(
        8 * (module.in_features + module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    )
    prompts = [
        json.loads(line)["prompt"] for line in Path(prompt_file).read_text().splitlines() if line
    ]
    lengths = [len(ids) for ids in prompt_token_ids(tokenizer, prompts)]
    return {
        "params": model.num_parameters(),
        "lora_params": lora_params,
        "mean_prompt_tokens": sum(lengths) / len(lengths),
    }


def matmul_child(repeats: int = 9) -> dict:
    """Median GFLOP/s of ``torch.mm`` of two 1024 x 1024 fp32 matrices on one thread."""
    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 1024, generator=gen)
    b = torch.randn(1024, 1024, generator=gen)
    for _ in range(2):  # warm-up
        torch.mm(a, b)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        rates.append(2 * 1024**3 / (time.perf_counter() - start) / 1e9)
    return {"peak_gflops": statistics.median(rates), "samples_gflops": rates}


def ppo_child(
    folder: str,
    mode: str,
    work: str,
    train_file: str,
    eval_file: str,
    device: str = "cpu",
    precision: str = "fp32",
) -> dict:
    """One PPO iteration of ``mode`` on the model in ``folder``; its metrics and the peak RSS
    (and on a GPU the peak of allocated GPU memory)."""
    import torch

    from ppo_core.config import load_config
    from ppo_core.training.loop import train

    torch.set_num_threads(1)
    overrides = [
        f"model.policy={folder}",
        f"data.train_file={train_file}",
        f"data.eval_file={eval_file}",
        f"train.output_dir={work}/candidate",
        f"train.checkpoint_dir={work}/checkpoints",
        f"train.metrics_dir={work}/metrics",
        "train.iterations=1",
        "train.checkpoint_every=1",
        f"ppo.rollout_batch_size={ROLLOUT}",
        f"ppo.mini_batch_size={MINI}",
        f"ppo.micro_batch_size={MICRO}",
        f"ppo.epochs={EPOCHS}",
        "threads=1",
        f"device={device}",
        f"precision={precision}",
        f"generation.max_new_tokens={NEW_TOKENS}",
        "model.reward=bench.speed.memory_scaling:varied_reward",
        *MODES[mode],
    ]
    summary = train(load_config(overrides=overrides))
    metrics = summary.history[0]
    peak = peak_rss_bytes()
    kept = ("perf/", "rollout/response_length", "rollout/score_std", "ppo/grad_norm", "ppo/loss")
    result = {
        "peak_bytes": peak,
        "metrics": {k: v for k, v in metrics.items() if k.startswith(kept)},
    }
    if device == "cuda":
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    return result


def run_child(task: dict, label: str) -> dict:
    """Run ``task`` in a fresh process (working folder the repository, which is also put on
    ``PYTHONPATH`` so that ``model.reward=bench.speed.memory_scaling:varied_reward`` imports); its result
    (last stdout line) with its wall time, or ``{"error": ...}`` when it failed. The child's
    stderr is passed on, prefixed with ``label``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' loading and writing bars
    }
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", __spec__.name, "--child", json.dumps(task)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    for line in filter(str.strip, out.stderr.splitlines()):
        print(f"  [{label}] {line}", file=sys.stderr)
    if out.returncode != 0:
        return {"error": f"exit status {out.returncode}", "child_wall_s": wall}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["child_wall_s"] = wall
    return result


def update_flops(mode: str, params: int, mean_prompt_tokens: float, response_length: float):
    """(useful, done) FLOPs of the update: forward 2NT, backward 4NT (full) or 2NT (LoRA),
    plus one more forward 2NT done but not counted as useful with gradient checkpointing."""
    tokens = ROLLOUT * EPOCHS * (mean_prompt_tokens + response_length)
    useful = (2 + (4 if mode == "full" else 2)) * params * tokens
    done = useful + (2 * params * tokens if mode.endswith("ckpt") else 0)
    return tokens, useful, done


def describe_run(size: str, mode: str, built: dict, result: dict, peak_gflops: float) -> dict:
    row = {"size": size, "mode": mode, "params": built["params"], **result}
    if "error" in result:
        return row
    params, metrics = built["params"], result["metrics"]
    tokens, useful, done = update_flops(
        mode, params, built["mean_prompt_tokens"], metrics["rollout/response_length"]
    )
    gflops = useful / metrics["perf/update_s"] / 1e9
    row.update(
        {
            "lora_adapter_params": built["lora_params"] if mode != "full" else None,
            "peak_gib": result["peak_bytes"] / GIB,
            "bytes_per_param": result["peak_bytes"] / params,
            "reference_bytes": 4 * params if mode == "full" else 0,
            "reference_share": (4 * params if mode == "full" else 0) / result["peak_bytes"],
            "rollout_s": metrics["perf/rollout_s"],
            "update_s": metrics["perf/update_s"],
            "update_tokens": tokens,
            "update_flops_useful": useful,
            "update_flops_done": done,
            "update_gflops": gflops,
            "update_peak_fraction": gflops / peak_gflops,
        }
    )
    if "cuda_peak_bytes" in result:
        row["cuda_peak_gib"] = result["cuda_peak_bytes"] / GIB
    return row


def fit_max_params(rows: list[dict]) -> dict:
    """Least-squares ``peak = a + b N`` over ``rows``; ``N_max = (24 GiB - a) / b``."""
    points = [(r["params"], r["peak_bytes"]) for r in rows if "peak_bytes" in r]
    if len({n for n, _ in points}) < 2:
        return {"sizes": len(points), "note": "needs at least two sizes"}
    mean_n = sum(n for n, _ in points) / len(points)
    mean_p = sum(p for _, p in points) / len(points)
    slope = sum((n - mean_n) * (p - mean_p) for n, p in points) / sum(
        (n - mean_n) ** 2 for n, _ in points
    )
    intercept = mean_p - slope * mean_n
    n_max = (MACHINE_GIB * GIB - intercept) / slope if slope > 0 else None
    return {
        "sizes": len(points),
        "a_gib": intercept / GIB,
        "b_bytes_per_param": slope,
        "n_max_params_24gib": n_max,
    }


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(peak_gflops: float, every_run: list[dict], fits: dict) -> None:
    print(f"fp32 matmul peak (1 thread, 1024^3): {peak_gflops:.1f} GFLOP/s\n")
    print(
        "| size | mode | params | peak GiB | bytes/param | reference share | rollout s "
        "| update s | update GFLOP/s | of peak |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in every_run:
        if "error" in r:
            print(f"| {r['size']} | {r['mode']} | {r['params']:,} | failed: {r['error']} |")
            continue
        print(
            f"| {r['size']} | {r['mode']} | {r['params']:,} | {r['peak_gib']:.2f} "
            f"| {r['bytes_per_param']:.1f} | {r['reference_share']:.1%} | {r['rollout_s']:.1f} "
            f"| {r['update_s']:.1f} | {r['update_gflops']:.1f} "
            f"| {r['update_peak_fraction']:.0%} |"
        )
    print(
        f"\nExtrapolation, not a measurement: largest model each mode could run on a "
        f"{MACHINE_GIB} GiB machine, from a least-squares fit peak = a + b N over the sizes run\n"
    )
    print("| mode | sizes fitted | a GiB | b bytes/param | N_max (24 GiB) |")
    print("|---|---:|---:|---:|---:|")
    for mode, fit in fits.items():
        n_max = fit.get("n_max_params_24gib")
        print(
            f"| {mode} | {fit['sizes']} | {fmt(fit.get('a_gib'), '.2f')} "
            f"| {fmt(fit.get('b_bytes_per_param'), '.1f')} "
            f"| {fmt(n_max and n_max / 1e6, ',.0f')}{'M' if n_max else ''} |"
        )


def run_mode(
    task: dict, size: str, built: dict, peak_gflops: float, device: str, precision: str
) -> dict:
    """One PPO iteration of a built model in one mode, in a child process, as a table row."""
    mode = task["mode"]
    task = {"kind": "ppo", **task, "device": device, "precision": precision}
    result = run_child(task, f"{size} {mode}")
    row = describe_run(size, mode, built, result, peak_gflops)
    shutil.rmtree(task["work"], ignore_errors=True)
    if "error" in row:
        print(f"{size} {mode}: FAILED ({row['error']})", file=sys.stderr)
    else:
        print(
            f"{size} {mode}: peak {row['peak_gib']:.2f} GiB, rollout {row['rollout_s']:.1f} s, "
            f"update {row['update_s']:.1f} s, child {row['child_wall_s']:.0f} s",
            file=sys.stderr,
        )
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--qwen2", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "memory_scaling.json"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda also reports the peak of allocated GPU memory (bench/gpu/gpu.sh); the FLOP rate "
        "is still compared with the CPU matmul peak",
    )
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    from bench import common

    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    args.sizes = {size: SIZES[size] for size in args.sizes}
    if args.smoke:
        args.sizes, args.modes, args.qwen2 = {"smoke": SMOKE_SHAPE}, ["lora+ckpt"], False
        args.out = common.output_folder("memory_scaling") / "memory_scaling.json"
    return args


def measure(args: argparse.Namespace, peak_gflops: float) -> tuple[list, dict | None, dict]:
    """Every (size, mode) run, the Qwen2 run (or ``None``) and the models built, by size."""
    from ppo_core.base_sources.review_grammar import default_prompts

    rows: list[dict] = []
    qwen2: dict | None = None
    builds: dict[str, dict] = {}
    jobs = [("llama", size, shape, args.modes) for size, shape in args.sizes.items()]
    if args.qwen2:
        jobs.append(("qwen2", "qwen2-0.5B", QWEN2_SHAPE, ["lora+ckpt"]))
    with tempfile.TemporaryDirectory(prefix="memory_scaling-") as tmp:
        prompts = default_prompts(80, seed=0)
        train_file, eval_file = Path(tmp, "train.jsonl"), Path(tmp, "eval.jsonl")
        for path, chosen in ((train_file, prompts[:64]), (eval_file, prompts[64:])):
            path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in chosen))
        files = {"train_file": str(train_file), "eval_file": str(eval_file)}
        for family, size, shape, modes in jobs:
            folder = Path(tmp, f"model-{size}")
            build = {"family": family, "shape": shape, "folder": str(folder)}
            built = run_child(
                {"kind": "build", **build, "prompt_file": str(train_file)}, f"build {size}"
            )
            if "error" in built:
                sys.exit(f"building the {size} model failed ({built['error']})")
            seconds = built["child_wall_s"]
            print(
                f"built {size}: {built['params']:,} parameters in {seconds:.0f} s", file=sys.stderr
            )
            builds[size] = {"family": family, "shape": shape, **built}
            for mode in modes:
                task = {"folder": str(folder), "mode": mode, "work": str(Path(tmp, "run")), **files}
                row = run_mode(task, size, built, peak_gflops, args.device, args.precision)
                if family == "qwen2":
                    qwen2 = row
                else:
                    rows.append(row)
            shutil.rmtree(folder, ignore_errors=True)
    return rows, qwen2, builds


def main() -> None:
    from bench import common

    args = parse_args()
    if args.child:
        task = json.loads(args.child)
        kind = task.pop("kind")
        handler = {"build": build_child, "matmul": matmul_child, "ppo": ppo_child}[kind]
        print(json.dumps(handler(**task)))
        return
    started = time.perf_counter()
    peak = run_child({"kind": "matmul", **({"repeats": 1} if args.smoke else {})}, "matmul")
    if "error" in peak:
        sys.exit(f"the matmul peak measurement failed ({peak['error']})")
    peak_gflops = peak["peak_gflops"]
    print(f"matmul peak: {peak_gflops:.1f} GFLOP/s", file=sys.stderr)
    rows, qwen2, builds = measure(args, peak_gflops)
    every_run = [*rows, *([qwen2] if qwen2 else [])]
    fits = {mode: fit_max_params([r for r in rows if r["mode"] == mode]) for mode in args.modes}
    print_tables(peak_gflops, every_run, fits)
    for row in every_run:
        if "cuda_peak_gib" in row:
            print(f"{row['size']} {row['mode']}: GPU peak {row['cuda_peak_gib']:.2f} GiB")
    settings = {
        "rollout_batch_size": ROLLOUT,
        "mini_batch_size": MINI,
        "micro_batch_size": MICRO,
        "epochs": EPOCHS,
        "max_new_tokens": NEW_TOKENS,
        "threads": 1,
        "device": args.device,
        "precision": args.precision,
    }
    results = {
        "settings": settings,
        "matmul": peak,
        "models": builds,
        "runs": rows,
        "fits_24gib_extrapolation": fits,
        "qwen2": qwen2,
        "total_s": time.perf_counter() - started,
        "machine": common.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    failed = [f"{r['size']} {r['mode']}" for r in every_run if "error" in r]
    if args.smoke and failed:  # a full run reports its failures in the table and goes on
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
