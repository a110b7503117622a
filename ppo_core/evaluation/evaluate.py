"""Held-out evaluation of a policy against a baseline (layer 3).

For each model: sample ``samples_per_prompt`` responses for ``num_prompts`` held-out prompts with
the same seed and sampling settings, score them, and measure what guards against a reward that is
bought with degenerate text: KL to the reference (nats per sequence, the k1 sum over response
tokens, an unbiased estimate of the sequence KL), the reference's negative log-likelihood of the
responses (nats per token, at temperature 1: fluency as the reference model judges it), response
length, EOS rate, distinct-n, and with ``promote.check_reward`` a second, independent score
(``check_score``). The promotion gate compares them with the baseline's (docs/design.md).

Both models are scored with one reward: ``eval.reward`` when set, else ``model.reward``, which
must then be the reward the candidate was trained with (recorded in its
``training_summary.json``): a model folder never chooses the code that scores it.

Each model is sampled and decoded with its own tokenizer; the reward scores text, so scores
compare across tokenizers. KL does not: token ids only mean the same text under tokenizers with
one vocabulary. A candidate whose vocabulary is not the reference's is refused (the promotion
gate depends on its KL); a baseline whose vocabulary differs gets no KL, with a warning.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from ppo_core.config import Config, ConfigError
from ppo_core.evaluation.judging import check_reward_fn, eval_references, evaluation_rewards
from ppo_core.evaluation.markdown import escape_markdown
from ppo_core.evaluation.report import ModelReport, RewardChoice, metric_table, write_reports
from ppo_core.evaluation.task import task_metrics
from ppo_core.experience.engines import VLLMEngine, check_engine, open_engine
from ppo_core.experience.judges import load_reference
from ppo_core.experience.sampling import (
    POSITIVE_SCORE,
    longest_prompt,
    sample_responses,
    score_in_chunks,
    score_responses,
    with_validated_settings,
)
from ppo_core.files import first_line
from ppo_core.files.artifacts import TRAINED_CONFIG, TRAINING_SUMMARY
from ppo_core.files.output_paths import real_path
from ppo_core.math.masked import masked_sum
from ppo_core.models.causal_lm import load_tokenizer
from ppo_core.models.generation import check_chat_template
from ppo_core.models.policy import load_causal_lm
from ppo_core.models.vocabulary import (
    Vocabulary,
    reference_vocabulary,
    vocabulary_mismatch,
    vocabulary_of,
)
from ppo_core.parallel.runtime import Runtime, setup_runtime
from ppo_core.prompts import Prompt, load_prompts, prompt_text
from ppo_core.references import Reference, batch_references
from ppo_core.registry.lineage import origin_folder
from ppo_core.registry.rewards import REWARD_SPEC_PREFIX
from ppo_core.rewards.loading import RewardError, RewardFn, checked_scores

__all__ = [
    "EvaluationWarning",
    "ModelReport",
    "RewardChoice",
    "TokenizerMismatchError",
    "distinct_n",
    "escape_markdown",
    "evaluate",
    "evaluate_model",
    "evaluation_reward",
    "metric_table",
]

OTHER_TOKENIZER = "other tokenizer than the reference"
"""Why a baseline has no ``kl_to_reference`` (shown as ``n/a (...)`` in ``report.md``)."""


class EvaluationWarning(UserWarning):
    """Evaluation goes on, but not quite as configured: another reward than ``model.reward``, or
    a baseline whose KL to the reference cannot be measured."""


class TokenizerMismatchError(ConfigError):
    """The candidate's tokenizer is not the KL reference's, so its KL cannot be measured."""


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


def recorded_reward(candidate: str | Path) -> tuple[str, Path] | None:
    """The reward the candidate was trained with and the file that records it: ``reward`` in
    ``training_summary.json``, else ``model.reward`` in ``ppo_config.yaml`` (candidates saved
    before the summary named it); None for a folder with neither."""
    folder = Path(candidate)
    summary = folder / TRAINING_SUMMARY
    if summary.is_file():
        try:
            recorded = json.loads(summary.read_text())
        except (ValueError, OSError) as exc:
            raise RewardError(
                f"cannot read {summary} ({exc}), which names the reward the candidate was "
                "trained with; set eval.reward to choose the reward"
            ) from None
        reward = recorded.get("reward") if isinstance(recorded, dict) else None
        if isinstance(reward, str):
            return reward, summary
    config_file = folder / TRAINED_CONFIG
    if config_file.is_file():
        # Plain YAML, not OmegaConf: a tampered file must not get its ${...} resolved here.
        try:
            saved = yaml.safe_load(config_file.read_text())
        except (yaml.YAMLError, ValueError, OSError) as exc:
            raise RewardError(
                f"cannot read {config_file} ({first_line(exc)}), which names the reward the "
                "candidate was trained with; set eval.reward to choose the reward"
            ) from None
        model = saved.get("model") if isinstance(saved, dict) else None
        reward = model.get("reward") if isinstance(model, dict) else None
        if isinstance(reward, str) and "${" not in reward:
            return reward, config_file
    return None


def evaluation_reward(config: Config, candidate: str | Path) -> RewardChoice:
    """``eval.reward`` when set (with a warning when the candidate was trained with another),
    else ``model.reward``.

    A reward is code to run, and a model folder never chooses it: when the candidate's
    ``training_summary.json`` (or ``ppo_config.yaml``) names another reward than ``model.reward``
    and ``eval.reward`` is not set, evaluation stops with a :class:`RewardError` naming both
    and the key to set, instead of importing what the folder names."""
    recorded = recorded_reward(candidate)
    if config.eval.reward is not None:
        if recorded is not None and recorded[0] != config.eval.reward:
            _warn(
                f"scoring with eval.reward={config.eval.reward!r}; the candidate was trained "
                f"with {recorded[0]!r} (recorded in {recorded[1]})"
            )
        return RewardChoice(config.eval.reward, "eval.reward")
    if recorded is not None and recorded[0] != config.model.reward:
        spec, file = recorded
        if spec.startswith(REWARD_SPEC_PREFIX) and config.model.reward.startswith(
            REWARD_SPEC_PREFIX
        ):
            # a reward version of the registry, not code: the one the candidate trained on
            return RewardChoice(spec, f"the reward version recorded in {file}")
        raise RewardError(
            f"the candidate was trained with the reward {spec!r} (recorded in {file}), not "
            f"model.reward={config.model.reward!r}; a model folder does not choose the code that "
            f"scores it: set eval.reward={spec!r} to score with the reward it was trained with, "
            f"or eval.reward={config.model.reward!r} to score with the configured one"
        )
    return RewardChoice(config.model.reward, "model.reward")


def _warn(message: str) -> None:
    warnings.warn(message, EvaluationWarning, stacklevel=3)


@torch.no_grad()
def evaluate_model(
    name: str,
    path: str | Path,
    reference: torch.nn.Module | None,
    tokenizer,
    prompts: list[Prompt],
    reward_fn: RewardFn,
    config: Config,
    runtime: Runtime,
    check_fn: RewardFn | None = None,
    origin: torch.nn.Module | None = None,
    previous_fn: RewardFn | None = None,
    engine: VLLMEngine | None = None,
    references: list[Reference] | None = None,
) -> ModelReport:
    """Sample ``eval.samples_per_prompt`` responses per prompt from the model in ``path`` with
    its own ``tokenizer``, with the rollout's own sampling and scoring code, and measure them.
    ``reference`` is None when the model's tokenizer is not the reference's: no KL and no
    reference NLL then. ``engine`` (``generation.engine=vllm``) samples instead of the loop.
    ``check_fn``, when given, scores the same responses as ``check_score``,
    and ``previous_fn`` (the reward version before the one the candidate trained on) as
    ``previous_reward_score``.
    ``origin``, the first model of a chain of generations when it is not the reference, gives
    ``kl_to_origin`` and ``origin_nll`` as the reference gives its two (without it they are the
    reference's: the chain starts at the reference)."""
    model = load_causal_lm(path, name, config.model.trust_remote_code).to(runtime.device)
    k = config.eval.samples_per_prompt
    expanded = [p for p in prompts for _ in range(k)]
    batch_size = config.ppo.rollout_batch_size
    temperature = config.generation.temperature
    torch.manual_seed(config.eval.seed)
    generated = sample_responses(
        model, tokenizer, expanded, config.generation, runtime, batch_size, engine=engine
    )
    mask = generated.response_mask
    guard_metrics: dict[str, float] = {}
    if reference is not None:

        def logprobs_of(scorer: torch.nn.Module, at_temperature: float) -> torch.Tensor:
            return score_in_chunks(
                scorer, generated, at_temperature, runtime, batch_size, with_values=False
            ).logprobs

        own = logprobs_of(model, temperature)
        kl, nll = _drift_from(reference, own, mask, logprobs_of, temperature)
        guard_metrics = {"kl_to_reference": kl, "reference_nll": nll}
        if origin is None:  # the chain's origin is the reference itself
            guard_metrics.update(kl_to_origin=kl, origin_nll=nll)
        else:
            kl, nll = _drift_from(origin, own, mask, logprobs_of, temperature)
            guard_metrics.update(kl_to_origin=kl, origin_nll=nll)
    del model
    given = batch_references(
        None if references is None else [r for r in references for _ in range(k)],
        config.data.reference_fields,
    )
    responses, score = score_responses(reward_fn, tokenizer, expanded, generated, given)
    guard_metrics.update(_judged(expanded, responses, given, check_fn, previous_fn))
    if given:  # answers to check against: the task's accuracy and pass@k
        guard_metrics.update(task_metrics(score, k, reward_fn, given.get("task")))
    metrics = {**_response_metrics(score, generated, responses), **guard_metrics}
    samples = [
        {"prompt": prompt_text(p), "response": r, "score": round(float(s), 4)}
        for p, r, s in list(zip(expanded, responses, score.tolist(), strict=True))[
            : config.eval.num_examples
        ]
    ]
    return ModelReport(
        name=name,
        path=str(path),
        metrics=metrics,
        samples=samples,
        unmeasured=(
            {} if reference is not None else dict.fromkeys(REFERENCE_METRICS, OTHER_TOKENIZER)
        ),
    )


def _judged(
    prompts: list[Prompt],
    responses: list[str],
    references: dict[str, list] | None,
    check_fn: RewardFn | None,
    previous_fn: RewardFn | None,
) -> dict[str, float]:
    """The mean score of the gate's check reward and of the previous reward version, each that
    is given, on the same responses."""
    judged = {}
    for metric, scorer, what in (
        ("check_score", check_fn, "promote.check_reward"),
        ("previous_reward_score", previous_fn, "the previous reward version"),
    ):
        if scorer is not None:
            raw = (
                scorer(prompts, responses, references) if references else scorer(prompts, responses)
            )
            judged[metric] = checked_scores(raw, len(responses), what).mean().item()
    return judged


def _response_metrics(score: torch.Tensor, generated, responses: list[str]) -> dict[str, float]:
    """What the responses themselves say: their scores (mean, standard deviation, share above
    :data:`POSITIVE_SCORE`), length, EOS rate and distinct-n."""
    mask = generated.response_mask
    return {
        "score": score.mean().item(),
        "score_std": score.std().item() if len(score) > 1 else 0.0,
        "positive_rate": (score > POSITIVE_SCORE).float().mean().item(),
        "response_length": mask.sum(dim=1).float().mean().item(),
        "eos_rate": generated.has_eos.float().mean().item(),
        "distinct_1": distinct_n(responses, 1),
        "distinct_2": distinct_n(responses, 2),
        "num_samples": float(len(responses)),
    }


REFERENCE_METRICS = ("kl_to_reference", "reference_nll", "kl_to_origin", "origin_nll")
"""What a model whose tokenizer is not the reference's gets no value of."""


def _drift_from(
    scorer: torch.nn.Module,
    own_logprobs: torch.Tensor,
    mask: torch.Tensor,
    logprobs_of,
    temperature: float,
) -> tuple[float, float]:
    """The model's KL to ``scorer`` (nats per sequence: the k1 sum over response tokens, mean
    over responses) and ``scorer``'s NLL of the responses (nats per token, at temperature 1).
    ``own_logprobs`` and ``mask``: ``[B, T]``."""
    scorer_logprobs = logprobs_of(scorer, temperature)
    kl = masked_sum(own_logprobs - scorer_logprobs, mask, dim=1)
    # Fluency is judged by the scorer's own distribution, not the sampling temperature's.
    plain = scorer_logprobs if temperature == 1.0 else logprobs_of(scorer, 1.0)
    tokens = mask.sum().clamp(min=1)
    return kl.mean().item(), (-masked_sum(plain, mask) / tokens).item()


def evaluate(
    config: Config,
    candidate: str | Path,
    baseline: str | Path | None = None,
    output_dir: str | Path | None = None,
) -> dict[str, ModelReport]:
    """Evaluate ``candidate`` (and ``baseline``, when given) and write ``metrics.json``,
    ``models.json``, ``samples.json`` and ``report.md`` to ``output_dir`` (default
    ``eval.output_dir``).

    Raises :class:`TokenizerMismatchError` before sampling anything when the candidate's
    tokenizer is not the KL reference's. The prompt token bound is the one ``ppo validate``
    held the data to, where it recorded one."""
    config = with_validated_settings(config, config.data.eval_file)
    runtime = setup_runtime(config, distributed=False, model_folder=candidate)
    check_engine(config, runtime)
    prompts = load_prompts(
        config.data.eval_file,
        config.data.prompt_field,
        max_rows=config.data.max_rows_per_file,
        max_bytes=config.data.max_bytes_per_file,
    )[: config.eval.num_prompts]
    references = eval_references(config, len(prompts))
    models = (
        {"candidate": candidate}
        if baseline is None
        else {"candidate": candidate, "baseline": baseline}
    )
    tokenizers = {
        name: load_tokenizer(path, config.model.trust_remote_code) for name, path in models.items()
    }
    for name, path in models.items():
        check_chat_template(tokenizers[name], prompts, path, f"the {name}")
    longest = max(
        longest_prompt(tokenizer, prompts, config, config.data.eval_file)
        for tokenizer in tokenizers.values()
    )
    reference_vocab, measure_kl = _kl_measurable(config, models, tokenizers)
    reward = evaluation_reward(config, candidate)
    reward_fn, previous, previous_fn = evaluation_rewards(config, reward, runtime)
    check_fn = check_reward_fn(config, runtime)
    reference = load_reference(config.model, runtime.device)
    origin_path, origin = _origin_model(config, reference_vocab, runtime)
    # one start for both models; the architecture is the base's (a candidate folder also holds
    # its value head, which vLLM would try to load as the model's)
    with open_engine(config, runtime, config.model.policy, longest) as engine:
        reports = {
            name: evaluate_model(
                name,
                path,
                reference if measure_kl[name] else None,
                tokenizers[name],
                prompts,
                reward_fn,
                config,
                runtime,
                check_fn,
                origin,
                previous_fn,
                engine,
                references,
            )
            for name, path in models.items()
        }
    write_reports(
        reports,
        Path(output_dir or config.eval.output_dir),
        config,
        len(prompts),
        reward=reward,
        previous_reward=previous,
        reference=reference_vocab.folder,
        origin=str(origin_path),
    )
    return reports


def _kl_measurable(
    config: Config, models: dict[str, str | Path], tokenizers: dict[str, Any]
) -> tuple[Vocabulary, dict[str, bool]]:
    """The KL reference's vocabulary, and for each model whether its KL to the reference can be
    measured (one vocabulary). A candidate with another one is refused; a baseline gets a
    warning and no KL."""
    reference_vocab = reference_vocabulary(
        config.model.policy, config.model.reference, config.model.trust_remote_code
    )
    candidate_vocab = vocabulary_of(models["candidate"], tokenizers["candidate"])
    mismatch = vocabulary_mismatch(candidate_vocab, reference_vocab)
    if mismatch is not None:
        raise _refusal(config, models["candidate"], candidate_vocab, reference_vocab, mismatch)
    measure_kl = {"candidate": True}
    if "baseline" in models:
        baseline_vocab = vocabulary_of(models["baseline"], tokenizers["baseline"])
        mismatch = vocabulary_mismatch(baseline_vocab, reference_vocab)
        measure_kl["baseline"] = mismatch is None
        if mismatch is not None:
            _warn(
                f"the baseline {baseline_vocab.describe()} has another tokenizer than the KL "
                f"reference {reference_vocab.describe()}: {mismatch}. It is sampled and decoded "
                f"with its own tokenizer and scored with the same reward, but its KL to the "
                "reference is not measured (n/a in report.md, absent from metrics.json), and its "
                "response_length counts its own tokens"
            )
    return reference_vocab, measure_kl


def _origin_model(
    config: Config, reference_vocab: Vocabulary, runtime: Runtime
) -> tuple[Path, torch.nn.Module | None]:
    """The chain's origin (:func:`ppo_core.registry.lineage.origin_folder`) and the model loaded for
    scoring, None when it is the KL reference's own folder (the first generation of a chain)."""
    folder = origin_folder(config.model.policy)
    reference = config.model.reference or config.model.policy
    if real_path(folder) == real_path(reference):
        return folder, None
    tokenizer = load_tokenizer(folder, config.model.trust_remote_code)
    mismatch = vocabulary_mismatch(vocabulary_of(folder, tokenizer), reference_vocab)
    if mismatch is not None:
        raise TokenizerMismatchError(
            f"the chain's origin {str(folder)!r} has another tokenizer than the KL reference: "
            f"{mismatch}; drift from the origin cannot be measured"
        )
    model = load_causal_lm(folder, "the chain's origin", config.model.trust_remote_code)
    return folder, model.to(runtime.device)


def _refusal(
    config: Config,
    candidate: str | Path,
    candidate_vocab: Vocabulary,
    reference_vocab: Vocabulary,
    mismatch: str,
) -> TokenizerMismatchError:
    key = "model.reference" if config.model.reference else "model.policy"
    trained_against = _recorded_reference(candidate)
    hint = (
        f" (its {TRAINING_SUMMARY} names {trained_against})"
        if trained_against and trained_against != reference_vocab.folder
        else ""
    )
    return TokenizerMismatchError(
        f"the candidate {candidate_vocab.describe()} has another tokenizer than the KL reference "
        f"{reference_vocab.describe()}, named by {key}: {mismatch}. Its KL to the reference, which "
        f"promote.max_kl gates, cannot be measured across tokenizers; set {key} to the folder the "
        f"candidate was trained against{hint}, or evaluate another candidate"
    )


def _recorded_reference(candidate: str | Path) -> str | None:
    try:
        recorded = json.loads((Path(candidate) / TRAINING_SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    reference = recorded.get("reference") if isinstance(recorded, dict) else None
    return reference if isinstance(reference, str) else None
