"""Held-out evaluation of a policy against a baseline (layer 3).

For each model: sample ``samples_per_prompt`` responses for ``num_prompts`` held-out prompts with
the same seed and sampling settings, score them, and measure what guards against a reward that is
bought with degenerate text: KL to the reference (nats per sequence, the k1 sum over response
tokens, an unbiased estimate of the sequence KL), response length, EOS rate and distinct-n.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ppo_core.config import Config
from ppo_core.files import atomic_folder
from ppo_core.math.masked import masked_sum
from ppo_core.modeling.data import load_prompts
from ppo_core.modeling.policy import load_causal_lm, load_tokenizer
from ppo_core.modeling.reward_loading import RewardFn
from ppo_core.rollout import (
    POSITIVE_SCORE,
    build_reward,
    load_reference,
    sample_responses,
    score_in_chunks,
    score_responses,
)
from ppo_core.runtime import Runtime, setup_runtime

__all__ = ["ModelReport", "distinct_n", "evaluate", "evaluate_model"]


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-grams over all n-grams of whitespace tokens, pooled over ``texts`` (Li et al.
    2016, "A Diversity-Promoting Objective Function for Neural Conversation Models")."""
    total, seen = 0, set()
    for text in texts:
        words = text.split()
        grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
        total += len(grams)
        seen.update(grams)
    return len(seen) / total if total else 0.0


@dataclass
class ModelReport:
    """Evaluation of one model."""

    name: str
    path: str
    metrics: dict[str, float]
    samples: list[dict[str, object]]


@torch.no_grad()
def evaluate_model(
    name: str,
    path: str | Path,
    reference: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    reward_fn: RewardFn,
    config: Config,
    runtime: Runtime,
) -> ModelReport:
    """Sample ``eval.samples_per_prompt`` responses per prompt from the model in ``path``, with
    the rollout's own sampling and scoring code, and measure them."""
    model = load_causal_lm(path, name, config.model.trust_remote_code).to(runtime.device)
    expanded = [p for p in prompts for _ in range(config.eval.samples_per_prompt)]
    batch_size = config.ppo.rollout_batch_size
    temperature = config.generation.temperature
    torch.manual_seed(config.eval.seed)
    generated = sample_responses(
        model, tokenizer, expanded, config.generation, runtime, chunk_size=batch_size
    )
    logprobs = score_in_chunks(
        model, generated, temperature, runtime, batch_size, with_values=False
    ).logprobs
    ref_logprobs = score_in_chunks(
        reference, generated, temperature, runtime, batch_size, with_values=False
    ).logprobs
    del model
    responses, score = score_responses(reward_fn, tokenizer, expanded, generated)
    mask = generated.response_mask
    kl = masked_sum(logprobs - ref_logprobs, mask, dim=1).cpu()
    metrics = {
        "score": score.mean().item(),
        "score_std": score.std().item() if len(score) > 1 else 0.0,
        "positive_rate": (score > POSITIVE_SCORE).float().mean().item(),
        "kl_to_reference": kl.mean().item(),
        "response_length": mask.sum(dim=1).float().mean().item(),
        "eos_rate": generated.has_eos.float().mean().item(),
        "distinct_1": distinct_n(responses, 1),
        "distinct_2": distinct_n(responses, 2),
        "num_samples": float(len(responses)),
    }
    samples = [
        {"prompt": p, "response": r, "score": round(float(s), 4)}
        for p, r, s in list(zip(expanded, responses, score.tolist(), strict=True))[
            : config.eval.num_examples
        ]
    ]
    return ModelReport(name=name, path=str(path), metrics=metrics, samples=samples)


def evaluate(
    config: Config,
    candidate: str | Path,
    baseline: str | Path | None = None,
    output_dir: str | Path | None = None,
) -> dict[str, ModelReport]:
    """Evaluate ``candidate`` (and ``baseline``, when given) and write ``metrics.json``,
    ``samples.json`` and ``report.md`` to ``output_dir`` (default ``eval.output_dir``)."""
    runtime = setup_runtime(config, distributed=False)
    prompts = load_prompts(config.data.eval_file, config.data.prompt_field)[
        : config.eval.num_prompts
    ]
    tokenizer = load_tokenizer(candidate, config.model.trust_remote_code)
    reference = load_reference(config.model, runtime.device)
    reward_fn = build_reward(config.model, runtime.device)
    models = (
        {"candidate": candidate}
        if baseline is None
        else {"candidate": candidate, "baseline": baseline}
    )
    reports = {
        name: evaluate_model(name, path, reference, tokenizer, prompts, reward_fn, config, runtime)
        for name, path in models.items()
    }
    write_reports(reports, Path(output_dir or config.eval.output_dir), config, len(prompts))
    return reports


def write_reports(
    reports: dict[str, ModelReport], folder: Path, config: Config, num_prompts: int
) -> None:
    """``metrics.json`` (flat, for ``dvc metrics``), ``models.json`` (which folders were
    compared), ``samples.json`` and a Markdown report."""

    def write(tmp: Path) -> None:
        flat = {
            f"{name}/{key}": value
            for name, r in reports.items()
            for key, value in r.metrics.items()
        }
        if "baseline" in reports:
            flat["delta/score"] = (
                reports["candidate"].metrics["score"] - reports["baseline"].metrics["score"]
            )
        flat["num_prompts"] = num_prompts
        (tmp / "metrics.json").write_text(json.dumps(flat, indent=1, sort_keys=True))
        (tmp / "models.json").write_text(json.dumps({n: r.path for n, r in reports.items()}))
        (tmp / "samples.json").write_text(
            json.dumps({name: r.samples for name, r in reports.items()}, indent=1)
        )
        (tmp / "report.md").write_text(markdown_report(reports, num_prompts, config))

    atomic_folder(folder, write)


def markdown_report(reports: dict[str, ModelReport], num_prompts: int, config: Config) -> str:
    names = list(reports)
    keys = list(reports[names[0]].metrics)
    lines = [
        "# Evaluation",
        "",
        f"{num_prompts} held-out prompts x {config.eval.samples_per_prompt} samples, "
        f"temperature {config.generation.temperature}, top-k {config.generation.top_k}, "
        f"top-p {config.generation.top_p}, seed {config.eval.seed}, reward "
        f"`{config.model.reward}`.",
        "",
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for key in keys:
        lines.append(
            f"| {key} | " + " | ".join(f"{reports[n].metrics[key]:.4g}" for n in names) + " |"
        )
    for name in names:
        lines += ["", f"## Samples: {name} (`{reports[name].path}`)", ""]
        lines += [
            f"- {s['prompt']} → **{str(s['response']).strip()}** ({s['score']:+.3f})"
            for s in reports[name].samples
        ]
    return "\n".join(lines) + "\n"
