"""Generation and PPO-update throughput on one accelerator, with model FLOPs utilisation (MFU).

For each model config (the tiny default, 2x128, and a GPT-2 of about 100M parameters, 12x768
with the GPT-2 vocabulary) it measures, after warm-up:

- generation: response tokens per second of ``model.generate`` (KV cache, sampling) on a batch
  of random prompts, every row running the full length, and of the pipeline's own sampling loop
  (``ppo_core.models.sampling.sample_tokens``) on the same prompts (random weights end almost
  no row early, so both compute the same tokens);
- update: response tokens per second of the PPO update's forward and backward passes
  (``score_sequences`` on an ``ActorCritic`` with a value head, exact micro-batch accumulation)
  plus the optimizer step.

MFU = achieved model FLOPs / peak FLOPs, with model FLOPs counted the usual way (Kaplan et al.
2020, section 2.1; Chowdhery et al. 2022, appendix B): ``2 N`` per token forward, ``6 N`` forward
and backward, plus attention ``2 n_layer L d`` per token forward (times 3 with backward), N the
non-embedding parameter count plus the LM head. The peak is ``--peak-tflops`` (default 989, the
H200's dense bf16 figure); on the CPU MFU is not reported.

    bash bench/gpu/gpu.sh                                  # on a CUDA machine: bf16, both configs
    .venv/bin/python -m bench.gpu.gpu_throughput --smoke   # seconds; on the CPU without CUDA

Writes ``bench/results/gpu_throughput.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    # the tiny default's shape, with room for 64 prompt + 128 response positions
    "tiny": dict(vocab_size=1024, n_layer=2, n_embd=128, n_head=4, n_positions=256),
    "gpt2-100m": dict(vocab_size=50257, n_layer=12, n_embd=768, n_head=12, n_positions=1024),
}


def model_flops_per_token(config, seq_len: int) -> float:
    """Forward FLOPs per token: 2 x (non-embedding params + LM head) + attention scores."""
    d, layers, vocab = config.n_embd, config.n_layer, config.vocab_size
    non_embedding = layers * 12 * d * d
    return 2 * (non_embedding + d * vocab) + 2 * layers * seq_len * d


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ppo_core.models.causal_lm import fuse_activations
    from ppo_core.models.policy import ActorCritic

    config = GPT2Config(
        **CONFIGS[name],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    policy = fuse_activations(GPT2LMHeadModel(config)).to(device=device, dtype=dtype)
    policy.generation_config.pad_token_id = 0
    policy.generation_config.eos_token_id = 2
    head = torch.nn.Linear(config.n_embd, 1).to(device=device, dtype=torch.float32)
    return config, ActorCritic(policy, head)


def measure_generation(model, config, args, device) -> dict[str, float]:
    from transformers import GenerationConfig

    generation = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=1.0,
        max_new_tokens=args.response_length,
        min_new_tokens=args.response_length,
        pad_token_id=0,
        eos_token_id=2,
    )
    prompts = torch.randint(4, config.vocab_size, (args.batch, args.prompt_length), device=device)
    mask = torch.ones_like(prompts)
    times = []
    for step in range(args.steps + 1):
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.policy.generate(
                input_ids=prompts, attention_mask=mask, generation_config=generation
            )
        synchronize(device)
        if step:  # the first call is warm-up
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = args.batch * args.response_length
    flops = model_flops_per_token(config, args.prompt_length + args.response_length) * tokens
    result = {
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tflops": flops / seconds / 1e12,
    }
    result["sampling_loop"] = measure_sampling_loop(model, prompts, mask, args, device)
    return result


def measure_sampling_loop(model, prompts, mask, args, device) -> dict[str, float]:
    """The pipeline's sampling loop on the prompts ``generate`` got: response tokens per second
    (the tokens it drew, up to each row's end)."""
    from ppo_core.models.sampling import sample_tokens

    times, drawn = [], []
    for step in range(args.steps + 1):
        synchronize(device)
        start = time.perf_counter()
        response = sample_tokens(
            model.policy,
            prompts,
            mask,
            max_new_tokens=args.response_length,
            stop_ids=[2],
            pad_token_id=0,
        ).response_ids
        synchronize(device)
        if step:
            times.append(time.perf_counter() - start)
            drawn.append(int((response != 0).sum()))
    seconds = statistics.median(times)
    return {"seconds": seconds, "tokens_per_s": statistics.median(drawn) / seconds}


def measure_update(model, config, args, device, autocast) -> dict[str, float]:
    from ppo_core.math.accumulation import accumulate_gradients
    from ppo_core.math.objective import PPOObjective
    from ppo_core.models.scoring import score_sequences

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    prompt_ids = torch.randint(
        4, config.vocab_size, (args.batch, args.prompt_length), device=device
    )
    response_ids = torch.randint(
        4, config.vocab_size, (args.batch, args.response_length), device=device
    )
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    response_mask = torch.ones_like(response_ids, dtype=torch.bool)
    micro = args.micro or args.batch
    micro_batches = [slice(i, i + micro) for i in range(0, args.batch, micro)]
    objective = PPOObjective()  # the trainer's objective with its default coefficients
    old_logprobs = torch.full(response_ids.shape, -7.0, device=device)
    advantages = torch.randn(response_ids.shape, device=device)
    old_values = torch.zeros(response_ids.shape, device=device)
    returns = torch.randn(response_ids.shape, device=device)

    def loss_fn(rows: slice):
        with autocast():
            out = score_sequences(
                model,
                prompt_ids[rows],
                prompt_mask[rows],
                response_ids[rows],
                response_mask[rows],
                with_entropy=True,
            )
        return objective(
            out.logprobs,
            out.values,
            out.entropy,
            old_logprobs[rows],
            old_values[rows],
            advantages[rows],
            returns[rows],
            response_mask[rows],
        )

    times = []
    model.train()
    for step in range(args.steps + 1):
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        accumulate_gradients(
            micro_batches, loss_fn, count_fn=lambda rows: objective.count(response_mask[rows])
        )
        optimizer.step()
        synchronize(device)
        if step:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = args.batch * args.response_length
    all_tokens = args.batch * (args.prompt_length + args.response_length)
    flops = (
        3 * model_flops_per_token(config, args.prompt_length + args.response_length) * all_tokens
    )
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--micro", type=int, default=32, help="update micro-batch (0: whole batch)")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--response-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "gpu_throughput.json"
    )
    from bench import common

    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"{common.HELP}; on the CPU when torch sees no CUDA device",
    )
    args = parser.parse_args()
    if args.smoke:
        args.configs, args.batch, args.micro, args.steps = ["tiny"], 4, 2, 1
        args.prompt_length = args.response_length = 4
        args.out = common.output_folder("gpu_throughput") / "gpu_throughput.json"
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            print("no CUDA device visible to torch: the smoke run measures the CPU")
            args.device = "cpu"
    device = torch.device(args.device)
    # bf16 weights for generation; the update keeps fp32 master weights under bf16 autocast
    results = {}
    for name in args.configs:
        gen_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        config, model = build(name, device, gen_dtype)
        generation = measure_generation(model, config, args, device)
        model = model.float()
        autocast = (
            (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
            if args.precision == "bf16"
            else contextlib.nullcontext
        )
        update = measure_update(model, config, args, device, autocast)
        params = sum(p.numel() for p in model.policy.parameters())
        row = {"parameters": params, "generation": generation, "update": update}
        if device.type == "cuda":
            for phase in ("generation", "update"):
                row[phase]["mfu"] = row[phase]["tflops"] / args.peak_tflops
        results[name] = row
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"{'config':>10} {'params':>8} {'gen tok/s':>10} {'gen MFU':>8} {'upd tok/s':>10} "
        f"{'upd MFU':>8} {'loop tok/s':>10}"
    )
    for name, row in results.items():
        g, u = row["generation"], row["update"]
        mfu = {k: f"{v['mfu']:.2%}" if "mfu" in v else "-" for k, v in (("g", g), ("u", u))}
        print(
            f"{name:>10} {row['parameters'] / 1e6:>7.1f}M {g['tokens_per_s']:>10.0f} "
            f"{mfu['g']:>8} {u['tokens_per_s']:>10.0f} {mfu['u']:>8} "
            f"{g['sampling_loop']['tokens_per_s']:>10.0f}"
        )
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "device": device_name,
                "torch": torch.__version__,
                "settings": {k: str(v) for k, v in vars(args).items()},
                "results": results,
                "machine": common.machine(),
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
