"""Held-out evaluation of a policy against a baseline (layer 3).

For each model: sample ``samples_per_prompt`` responses for ``num_prompts`` held-out prompts with
the same seed and sampling settings, score them, and measure what guards against a reward that is
bought with degenerate text: KL to the reference (nats per sequence, the k1 sum over response
tokens, an unbiased estimate of the sequence KL), response length, EOS rate and distinct-n.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ppo_core.config import Config
from ppo_core.math.masked import masked_sum
from ppo_core.modeling.checkpoint import atomic_folder
from ppo_core.modeling.data import load_prompts
from ppo_core.modeling.generation import decode_responses, generate_responses
from ppo_core.modeling.policy import load_causal_lm, load_tokenizer, score_sequences

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
    reward_fn: Callable[[list[str], list[str]], Tensor],
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    batch_size: int,
    device: torch.device,
    num_examples: int,
    trust_remote_code: bool = False,
) -> ModelReport:
    """Sample, score and measure one model on ``prompts``."""
    model = load_causal_lm(path, name, trust_remote_code).to(device)
    expanded = [p for p in prompts for _ in range(samples_per_prompt)]
    torch.manual_seed(seed)
    scores, kls, lengths, eos, responses = [], [], [], [], []
    for start in range(0, len(expanded), batch_size):
        chunk = expanded[start : start + batch_size]
        generated = generate_responses(model, tokenizer, chunk, max_new_tokens, temperature,
                                       top_k, top_p, device)
        args = (generated.prompt_ids, generated.prompt_mask, generated.response_ids,
                generated.response_mask)
        logprobs = score_sequences(model, *args, temperature=temperature, with_values=False).logprobs
        ref = score_sequences(reference, *args, temperature=temperature, with_values=False).logprobs
        kls.append(masked_sum(logprobs - ref, generated.response_mask, dim=1).cpu())
        texts = decode_responses(tokenizer, generated.response_ids, generated.response_mask)
        scores.append(torch.as_tensor(reward_fn(chunk, texts), dtype=torch.float32).cpu())
        lengths.append(generated.response_mask.sum(dim=1).float().cpu())
        eos.append(generated.has_eos.float().cpu())
        responses.extend(texts)
    del model
    score = torch.cat(scores)
    kl = torch.cat(kls)
    metrics = {
        "score": score.mean().item(),
        "score_std": score.std().item() if len(score) > 1 else 0.0,
        "positive_rate": (score > 0.05).float().mean().item(),
        "kl_to_reference": kl.mean().item(),
        "response_length": torch.cat(lengths).mean().item(),
        "eos_rate": torch.cat(eos).mean().item(),
        "distinct_1": distinct_n(responses, 1),
        "distinct_2": distinct_n(responses, 2),
        "num_samples": float(len(responses)),
    }
    samples = [
        {"prompt": p, "response": r, "score": round(float(s), 4)}
        for p, r, s in list(zip(expanded, responses, score.tolist(), strict=True))[:num_examples]
    ]
    return ModelReport(name=name, path=str(path), metrics=metrics, samples=samples)


def evaluate(config: Config, candidate: str | Path, baseline: str | Path | None = None,
             output_dir: str | Path | None = None) -> dict[str, ModelReport]:
    """Evaluate ``candidate`` (and ``baseline``, when given) and write ``metrics.json``,
    ``samples.json`` and ``report.md`` to ``output_dir`` (default ``eval.output_dir``)."""
    from ppo_core.modeling.reward_loading import build_reward_fn
    from ppo_core.trainer import resolve_device

    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    trust = config.model.trust_remote_code
    prompts = load_prompts(config.data.eval_file, config.data.prompt_field)[: config.eval.num_prompts]
    tokenizer = load_tokenizer(candidate, trust)
    reference = load_causal_lm(config.model.reference or config.model.policy, "reference", trust)
    reference.to(device)
    reward_fn = build_reward_fn(config.model.reward, device=device, trust_remote_code=trust)
    gen = config.generation
    common = dict(samples_per_prompt=config.eval.samples_per_prompt,
                  max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                  top_k=gen.top_k, top_p=gen.top_p, seed=config.eval.seed,
                  batch_size=config.ppo.rollout_batch_size, device=device,
                  num_examples=config.eval.num_examples, trust_remote_code=trust)
    reports = {"candidate": evaluate_model("candidate", candidate, reference, tokenizer, prompts,
                                           reward_fn, **common)}
    if baseline is not None:
        reports["baseline"] = evaluate_model("baseline", baseline, reference, tokenizer, prompts,
                                             reward_fn, **common)
    write_reports(reports, Path(output_dir or config.eval.output_dir), config, len(prompts))
    return reports


def write_reports(reports: dict[str, ModelReport], folder: Path, config: Config,
                  num_prompts: int) -> None:
    """``metrics.json`` (flat, for ``dvc metrics``), ``models.json`` (which folders were
    compared), ``samples.json`` and a Markdown report."""

    def write(tmp: Path) -> None:
        flat = {f"{name}/{key}": value for name, r in reports.items() for key, value in r.metrics.items()}
        if "baseline" in reports:
            flat["delta/score"] = reports["candidate"].metrics["score"] - reports["baseline"].metrics["score"]
        flat["num_prompts"] = num_prompts
        (tmp / "metrics.json").write_text(json.dumps(flat, indent=1, sort_keys=True))
        (tmp / "models.json").write_text(json.dumps({n: r.path for n, r in reports.items()}))
        (tmp / "samples.json").write_text(json.dumps(
            {name: r.samples for name, r in reports.items()}, indent=1))
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
        lines.append(f"| {key} | " + " | ".join(f"{reports[n].metrics[key]:.4g}" for n in names) + " |")
    for name in names:
        lines += ["", f"## Samples: {name} (`{reports[name].path}`)", ""]
        lines += [f"- {s['prompt']} → **{str(s['response']).strip()}** ({s['score']:+.3f})"
                  for s in reports[name].samples]
    return "\n".join(lines) + "\n"
