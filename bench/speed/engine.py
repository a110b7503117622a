"""The rollout engines side by side: the pipeline's sampling loop against the vLLM engine
(``generation.engine=vllm``, ``ppo_core/experience/engines.py``) on the recipe's chats.

For each row count, both engines sample one reply per film-review chat (temperature 1, the
recipe's ``--new-tokens``, stopping at EOS) from the same weights; medians over ``--repeats``
calls after one warm-up, the two interleaved. The engine's time includes giving it the weights
(as every rollout does); the weight load is also timed alone, and so is the engine's start.
The engine's log-probabilities of its draws are compared with the trainer's rescoring of them
(the gap every iteration logs). Tokens per second count the tokens each side sampled (the draws
differ, so do the lengths). Writes ``bench/results/engine.json``.

``--shape smollm2``, ``gpt2-124m`` or ``qwen2-0.5b`` samples from random weights of that shape
instead (a machine without the GGUF file, such as a lent GPU: ``bench/gpu/gpu.sh`` runs it
there), with the tiny default's tokenizer and plain prompts; random weights rarely end a row, so
both sides sample nearly every token.

    .venv/bin/python -m bench.speed.engine                 # SmolLM2-135M-Instruct (GGUF import)
    .venv/bin/python -m bench.speed.engine --rows 16 32 --precision bf16
    .venv/bin/python -m bench.speed.engine --device cuda --precision bf16 --shape smollm2 \
        --rows 32 128 --vllm-python python3               # on a GPU, vLLM in python3's env
    .venv/bin/python -m bench.speed.engine --smoke         # the tiny default, 2 rows
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu.gpu_throughput import CONFIGS as GPT2_CONFIGS
from bench.speed.memory_scaling import QWEN2_SHAPE

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from bench import common

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: SmolLM2 imported from GGUF)")
    parser.add_argument(
        "--shape", choices=list(SHAPES), help="random weights of this shape instead of a model"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the engine on the same GPU)")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engine.json")
    parser.add_argument("--smoke", action="store_true", help=f"{common.HELP} (the tiny default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="engine-") as tmp:
        if args.smoke:
            args.rows, args.new_tokens, args.repeats = [2], 4, 1
            args.out = common.output_folder("engine") / "engine.json"
        if args.shape:  # at --smoke, one block of the shape
            folder = random_model(Path(tmp) / args.shape, args.shape, one_block=args.smoke)
        elif args.smoke:
            folder = _tiny(Path(tmp) / "tiny")
        else:
            from bench.speed.lora_sampling import import_smollm2

            folder = Path(args.model) if args.model else import_smollm2(Path(tmp) / "smollm2")
        measure(args, folder)


def measure(args: argparse.Namespace, folder: Path) -> None:
    from bench import common
    from ppo_core.config import load_config
    from ppo_core.experience.engines import VLLMEngine
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.generation import generate_responses
    from ppo_core.models.policy import load_causal_lm

    bf16 = args.precision == "bf16"
    device = torch.device(args.device)
    model = load_causal_lm(folder, dtype=torch.bfloat16 if bf16 else torch.float32)
    model = model.to(device).eval()
    tokenizer = load_tokenizer(folder)
    generation = load_config(
        overrides=[
            "generation.engine=vllm",
            f"generation.vllm_python={args.vllm_python}",
            f"generation.max_new_tokens={args.new_tokens}",
        ]
    ).generation
    started = time.perf_counter()
    engine = VLLMEngine(
        folder,
        generation,
        max_model_len=min(512, _positions(model)),
        seed=0,
        device=device,
        bf16=bf16,
        threads=args.threads,
    )
    result: dict = {"start_s": time.perf_counter() - started, "rows": []}
    with engine:
        loads = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            engine.load_weights(model)
            loads.append(time.perf_counter() - started)
        result["weight_load_s"] = statistics.median(loads)
        for rows in args.rows:
            chats = common.chat_prompts(rows)
            plain = args.smoke or args.shape  # no chat template
            prompts = [row["messages"][0]["content"] if plain else row["messages"] for row in chats]

            def loop(seed: int, prompts=prompts):
                torch.manual_seed(seed)
                return generate_responses(
                    model,
                    tokenizer,
                    prompts,
                    args.new_tokens,
                    temperature=1.0,
                    device=device,
                    few_row_layouts=generation.few_row_layouts,
                )

            def vllm(seed: int, prompts=prompts):
                return engine.sample(model, tokenizer, prompts, len(prompts), [seed], device)

            row = {"rows": rows, "new_tokens": args.new_tokens}
            row.update(_tokens_per_s({"loop": loop, "vllm": vllm}, args.repeats, device))
            row["vllm_over_loop"] = row["tokens_per_s_vllm"] / row["tokens_per_s_loop"]
            row.update(_gap(model, vllm(0)))
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    result.update(
        model=args.shape or args.model or ("tiny" if args.smoke else "smollm2-gguf"),
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        precision=args.precision,
        threads=args.threads,
        machine=common.machine(),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    print(f"results in {args.out}")


SHAPES = {
    "smollm2": (
        "llama",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            max_position_embeddings=2048,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
    ),
    "gpt2-124m": ("gpt2", GPT2_CONFIGS["gpt2-100m"]),
    "qwen2-0.5b": (
        "qwen2",
        dict(
            QWEN2_SHAPE,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
        ),
    ),
}
"""Random-weight shapes: SmolLM2-135M's (Llama, 30 blocks of 576, tied), GPT-2 small's, and
Qwen2-0.5B's (24 blocks of 896, 2 key-value heads, its vocabulary of 151,936, tied)."""


def random_model(folder: Path, shape: str, one_block: bool = False) -> Path:
    """A model folder of ``shape`` (:data:`SHAPES`) with random weights (seed 0) and the tiny
    default's tokenizer, its special ids set; ``one_block``: a single block, for a smoke run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ppo_core.base_sources.review_grammar import generate_review_corpus
    from ppo_core.base_sources.tiny_default import train_tokenizer

    family, sizes = SHAPES[shape]
    tokenizer = train_tokenizer(generate_review_corpus(500, seed=0))
    blocks = {"n_layer" if family == "gpt2" else "num_hidden_layers": 1} if one_block else {}
    config = AutoConfig.for_model(
        family,
        **{**sizes, **blocks},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _tokens_per_s(sides: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """Each side's sampled tokens per second, the median of ``repeats`` calls after a warm-up
    round, the sides interleaved (``side(seed)`` returns a ``GeneratedBatch``)."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(repeats + 1):
        for name, side in sides.items():
            _synchronize(device)
            started = time.perf_counter()
            batch = side(repeat)
            _synchronize(device)
            seconds = time.perf_counter() - started
            if repeat:  # the first round warms up
                rates[name].append(float(batch.response_mask.sum()) / seconds)
    return {f"tokens_per_s_{name}": statistics.median(r) for name, r in rates.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tiny(folder: Path) -> Path:
    """The tiny default's recipe at its smallest with heads 32 wide (vLLM's CPU attention has
    no kernel for the 16-wide heads of ``bench/common.py``'s), no chat template: plain prompts."""
    from ppo_core.base_sources.tiny_default import build_tiny_default

    return build_tiny_default(
        folder,
        n_sentences=300,
        steps=2,
        batch_size=8,
        warmup_steps=1,
        n_layer=1,
        n_embd=64,
        n_head=2,
        num_threads=1,
    )


def _positions(model) -> int:
    from ppo_core.models.folders import POSITION_KEYS

    return next(getattr(model.config, key) for key in POSITION_KEYS if hasattr(model.config, key))


def _gap(model, batch) -> dict[str, float]:
    """The engine's log-probabilities of its draws against the trainer's rescoring (the
    rollout's own scoring pass, ``score_in_chunks``)."""
    from ppo_core.experience.sampling import score_in_chunks
    from ppo_core.parallel.runtime import Runtime
    from ppo_core.training.rollout import sampler_gap

    runtime = Runtime(device=batch.response_ids.device)
    trainer = score_in_chunks(model, batch, 1.0, runtime, len(batch.response_ids), False)
    gap = sampler_gap(batch.logprobs, trainer.logprobs, batch.response_mask)
    return {name.removeprefix("rollout/"): value for name, value in gap.items()}


if __name__ == "__main__":
    main()
