"""What a bf16 KL reference (``model.reference_dtype=bf16``) does to the KL term.

The policy samples responses in fp32 and scores them (old logprobs); the frozen reference then
scores the same tokens twice, loaded in fp32 and in bf16, and the per-token KL penalty
(``kl.estimator``, k1 by default) is computed against each. Reported: the mean KL per sequence
with each reference, the mean and largest absolute difference per sequence and per token, the
difference relative to the KL itself, and the bytes each reference's weights take.

By default the policy is the trained candidate of the default pipeline (``models/candidate``,
after ``make run``) and the reference its starting point (``models/base``), so the KL is the one
training actually sees; prompts are the held-out split. Writes
``bench/results/reference_dtype.json``.

    .venv/bin/python -m bench.exactness.reference_dtype [--policy models/candidate] [--reference models/base]
        [--prompts data/prepared/eval.parquet] [--batches 8] [--batch-size 64]
    .venv/bin/python -m bench.exactness.reference_dtype --smoke  # no `make run` needed

``--smoke`` builds a one-layer model twice on the spot (2 and 6 training steps, one tokenizer:
the policy is the longer trained one), one batch of 4 prompts, 4 new tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def measure(args: argparse.Namespace) -> dict:
    from ppo_core.config import GenerationConfig
    from ppo_core.experience.sampling import sample_responses, score_in_chunks
    from ppo_core.math.kl import kl_penalty
    from ppo_core.math.masked import masked_sum
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.policy import load_actor_critic, load_causal_lm
    from ppo_core.parallel.runtime import Runtime
    from ppo_core.prompts import load_prompts

    torch.set_num_threads(args.threads)
    runtime = Runtime()
    policy = load_actor_critic(args.policy)
    tokenizer = load_tokenizer(args.policy)
    references = {
        name: load_causal_lm(args.reference, "reference", dtype=dtype).requires_grad_(False)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    prompts = load_prompts(args.prompts)
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens)
    per_sequence: dict[str, list[torch.Tensor]] = {"fp32": [], "bf16": []}
    per_token_diff: list[torch.Tensor] = []
    for batch in range(args.batches):
        start = (batch * args.batch_size) % max(len(prompts) - args.batch_size, 1)
        chunk = prompts[start : start + args.batch_size]
        torch.manual_seed(batch)
        generated = sample_responses(
            policy.policy, tokenizer, chunk, generation, runtime, chunk_size=len(chunk)
        )
        mask = generated.response_mask
        old = score_in_chunks(policy, generated, 1.0, runtime, 16, with_values=False).logprobs
        token_kl = {}
        for name, reference in references.items():
            ref = score_in_chunks(reference, generated, 1.0, runtime, 16, with_values=False)
            token_kl[name] = kl_penalty(old, ref.logprobs, args.estimator, mask)
            per_sequence[name].append(masked_sum(token_kl[name], mask, dim=1))
        per_token_diff.append((token_kl["bf16"] - token_kl["fp32"])[mask.bool()])
    fp32, bf16 = torch.cat(per_sequence["fp32"]), torch.cat(per_sequence["bf16"])
    token_diff = torch.cat(per_token_diff).abs()
    sequence_diff = (bf16 - fp32).abs()

    def weight_bytes(model: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())

    return {
        "policy": args.policy,
        "reference": args.reference,
        "estimator": args.estimator,
        "sequences": len(fp32),
        "kl_per_sequence_fp32": fp32.mean().item(),
        "kl_per_sequence_bf16": bf16.mean().item(),
        "mean_kl_difference": (bf16.mean() - fp32.mean()).item(),
        "relative_mean_kl_difference": ((bf16.mean() - fp32.mean()) / fp32.mean()).item(),
        "mean_abs_sequence_difference": sequence_diff.mean().item(),
        "max_abs_sequence_difference": sequence_diff.max().item(),
        "mean_abs_token_difference": token_diff.mean().item(),
        "max_abs_token_difference": token_diff.max().item(),
        "reference_bytes_fp32": weight_bytes(references["fp32"]),
        "reference_bytes_bf16": weight_bytes(references["bf16"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="models/candidate")
    parser.add_argument("--reference", default="models/base")
    parser.add_argument("--prompts", default="data/prepared/eval.parquet")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--estimator", default="k1")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "reference_dtype.json"))
    from bench import common

    parser.add_argument("--smoke", action="store_true", help=common.HELP)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="reference_dtype-") as tmp:
        if args.smoke:
            args.batches, args.batch_size, args.max_new_tokens = 1, 4, 4
            args.out = str(common.output_folder("reference_dtype") / "reference_dtype.json")
            args.reference = str(common.tiny_model(Path(tmp) / "reference", steps=2))
            args.policy = str(common.tiny_model(Path(tmp) / "policy", steps=6))
            args.prompts = str(common.prompt_files(Path(tmp) / "prompts")[1])
        result = measure(args)
    result["machine"] = common.machine()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for key, value in result.items():
        print(f"{key:32s} {value:.6g}" if isinstance(value, float) else f"{key:32s} {value}")


if __name__ == "__main__":
    main()
