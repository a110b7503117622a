"""The PPO rollout (layer 3): sample responses, score them, and turn the scores into advantages.

Sampling and scoring are :mod:`ppo_core.experience.sampling`'s, shared with evaluation, so both
see the same prompts, positions and sampling distribution (docs/design.md section 8).
:func:`collect_rollout` adds the reward shaping of Ziegler et al.
(2019), "Fine-Tuning Language Models from Human Preferences": the per-token KL penalty plus the
score on the last response token (the score alone when the KL is in the loss instead), then the
advantages of ``ppo.advantage_estimator`` once per batch: GAE (Schulman et al. 2016) with the
critic's values, or a critic-free one (:mod:`ppo_core.math.advantages`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ppo_core.config import GenerationConfig, KLConfig, PPOConfig
from ppo_core.experience.engines import VLLMEngine
from ppo_core.experience.sampling import (
    POSITIVE_SCORE,
    sample_responses,
    score_in_chunks,
    score_responses,
)
from ppo_core.math.advantages import ESTIMATORS, AdvantageInputs, consecutive_groups
from ppo_core.math.kl import kl_penalty, token_rewards
from ppo_core.math.losses import truncated_importance_weights
from ppo_core.math.masked import masked_moments, masked_sum
from ppo_core.math.running_mean import RunningMean
from ppo_core.models.generation import GeneratedBatch
from ppo_core.models.policy import ActorCritic
from ppo_core.models.scoring import ScoredBatch
from ppo_core.parallel.runtime import Runtime
from ppo_core.prompts import Prompt
from ppo_core.rewards.loading import RewardFn
from ppo_core.rewards.verifiers import FAILED_REASONS, VERDICT_REASONS, reason_counts
from ppo_core.training.batch import RolloutBatch
from ppo_core.training.stopwatch import Stopwatch

__all__ = ["SamplerGapWarning", "SamplerGapWatch", "collect_rollout", "sampler_gap"]


@torch.no_grad()
def collect_rollout(
    actor_critic: ActorCritic,
    reference: torch.nn.Module,
    tokenizer,
    prompts: list[Prompt],
    reward_fn: RewardFn,
    *,
    ppo: PPOConfig,
    generation: GenerationConfig,
    kl: KLConfig,
    kl_coef: float,
    runtime: Runtime,
    chunk_seeds: Sequence[int] | None = None,
    merge_adapter: bool = True,
    engine: VLLMEngine | None = None,
    measure_gap: bool = True,
    references: Mapping[str, Sequence[Any]] | None = None,
) -> tuple[RolloutBatch, dict[str, float], list[str]]:
    """Generate, score and turn one batch of prompts into advantages and returns.

    ``kl_coef`` is the controller's current ``beta`` (``kl.coef`` only at the start); with
    ``kl.in_loss`` the rewards hold the score alone and the update adds the KL term. Under data
    parallelism batch-wide statistics (whitening, REINFORCE++'s normalisation, the metrics) are
    taken over every rank's rows; the groups of ``ppo.samples_per_prompt`` consecutive rows lie
    whole on this rank, so group statistics need no communication. With LoRA and
    ``merge_adapter`` the responses are sampled with the adapter merged into copies of the
    weights (``ActorCritic.sampling_model``), by the loop or the vLLM ``engine``; scoring always
    runs on the unmerged model. With ``ppo.old_logprobs=sampling`` and ``measure_gap`` a few
    rows are rescored for the sampler gap. ``references``: the rows' reference fields, for the
    reward. Returns the batch, its ``rollout/*`` metrics, and the responses."""
    all_ranks = runtime.parallel.active
    watch = Stopwatch()
    with watch.step("generate"), actor_critic.sampling_model(merge_adapter) as sampler:
        generated = sample_responses(
            sampler,
            tokenizer,
            prompts,
            generation,
            runtime,
            chunk_size=ppo.generation_batch_size or len(prompts),
            chunk_seeds=chunk_seeds,
            engine=engine,
            value_head=_value_head_for_sampling(actor_critic, ppo, engine),
        )
    with watch.step("score"):
        policy_scored, reference_scored = _score_with_both(
            actor_critic, reference, generated, generation.temperature, runtime, ppo
        )
    mask = generated.response_mask
    with watch.step("reward"):
        responses, raw_scores, scores = _rewarded(
            reward_fn, tokenizer, prompts, generated, references, ppo, runtime
        )
    token_kl = kl_penalty(policy_scored.logprobs, reference_scored.logprobs, kl.estimator, mask)
    reward_kl_coef = 0.0 if kl.in_loss else kl_coef
    rewards = token_rewards(scores, token_kl, mask, reward_kl_coef)
    advantages, returns = _advantages(
        ppo, scores, token_kl, reward_kl_coef, rewards, mask, policy_scored.values, all_ranks
    )
    batch = RolloutBatch(
        prompt_ids=generated.prompt_ids,
        prompt_mask=generated.prompt_mask,
        response_ids=generated.response_ids,
        response_mask=mask,
        old_logprobs=policy_scored.logprobs,
        ref_logprobs=reference_scored.logprobs,
        old_values=policy_scored.values,
        scores=scores,
        rewards=rewards,
        advantages=advantages,
        returns=returns,
        importance_weights=_importance_weights(ppo, generated, policy_scored.logprobs),
    )
    metrics = _rollout_metrics(batch, raw_scores, token_kl, generated.has_eos, all_ranks=all_ranks)
    metrics.update({"rollout/kl_coef": float(kl_coef), **reward_metrics(reward_fn, all_ranks)})
    rescorer = (actor_critic, generation.temperature, runtime) if measure_gap else None
    with watch.step("score"):
        metrics.update(_sampler_metrics(ppo, generated, batch, all_ranks, rescorer))
    metrics.update(watch.metrics())
    return batch, metrics, responses


def reward_metrics(reward_fn: RewardFn, all_ranks: bool) -> dict[str, float]:
    """:func:`verdict_metrics` and :func:`term_metrics` of the batch's reward."""
    return verdict_metrics(reward_fn, all_ranks) | term_metrics(reward_fn, all_ranks)


def verdict_metrics(reward_fn: RewardFn, all_ranks: bool) -> dict[str, float]:
    """For a verifier reward: ``reward/verifier_errors``, the replies it failed on (a timeout
    or an error, each scored 0.0), and ``verdict/<why>``, the share of replies of each
    verdict reason, over every rank's replies with ``all_ranks``; ``{}`` for another reward."""
    reasons = reason_counts(reward_fn)
    if not reasons:
        return {}
    # one fixed list on every rank, whatever reasons each rank's replies met
    counts = torch.tensor([float(reasons.get(n, 0)) for n in VERDICT_REASONS], dtype=torch.float64)
    if all_ranks:
        import torch.distributed as dist

        dist.all_reduce(counts)
    found = dict(zip(VERDICT_REASONS, counts.tolist(), strict=True))
    total = max(sum(found.values()), 1.0)
    metrics = {f"verdict/{n}": c / total for n, c in found.items() if c > 0}
    metrics["reward/verifier_errors"] = sum(found[n] for n in FAILED_REASONS)
    return metrics


def term_metrics(reward_fn: RewardFn, all_ranks: bool) -> dict[str, float]:
    """For several rewards (``model.reward_terms``): ``reward/<name>``, each term's mean
    unweighted score over the batch (every rank's rows with ``all_ranks``); ``{}`` for one."""
    terms = getattr(getattr(reward_fn, "source", reward_fn), "last_terms", None)
    if not isinstance(terms, dict) or not terms:
        return {}
    sums = torch.tensor(
        [float(t.sum()) for t in terms.values()] + [float(len(next(iter(terms.values()))))],
        dtype=torch.float64,
    )
    if all_ranks:
        import torch.distributed as dist

        dist.all_reduce(sums)
    count = max(float(sums[-1]), 1.0)
    return {
        f"reward/{name}": float(total) / count
        for name, total in zip(terms, sums[:-1].tolist(), strict=True)
    }


def _rewarded(
    reward_fn: RewardFn,
    tokenizer,
    prompts: list[Prompt],
    generated: GeneratedBatch,
    references: Mapping[str, Sequence[Any]] | None,
    ppo: PPOConfig,
    runtime: Runtime,
) -> tuple[list[str], Tensor, Tensor]:
    """The decoded responses, the reward's scores ``[B]`` on the run's device, and the scores
    with ``ppo.missing_eos_penalty`` taken from each response that did not end with EOS."""
    responses, raw_scores = score_responses(reward_fn, tokenizer, prompts, generated, references)
    raw_scores = raw_scores.to(runtime.device)
    if ppo.missing_eos_penalty is None:
        return responses, raw_scores, raw_scores
    penalised = raw_scores - ppo.missing_eos_penalty
    return responses, raw_scores, torch.where(generated.has_eos, raw_scores, penalised)


def _importance_weights(
    ppo: PPOConfig, generated: GeneratedBatch, trainer_logprobs: Tensor
) -> Tensor | None:
    """The TIS weights of the sampled tokens with ``ppo.tis_cap``, else None."""
    if ppo.tis_cap is None or generated.logprobs is None:
        return None
    return truncated_importance_weights(
        trainer_logprobs, generated.logprobs, generated.response_mask, ppo.tis_cap
    )


def _sampler_metrics(
    ppo: PPOConfig,
    generated: GeneratedBatch,
    batch: RolloutBatch,
    all_ranks: bool,
    rescorer: tuple[ActorCritic, float, Runtime] | None,
) -> dict[str, float]:
    """The sampler gap and, when TIS is on, the mean TIS weight. With ``rescore`` the gap is
    every row's, the old log-probabilities being the trainer's; with ``sampling`` (they are the
    sampler's own) the policy of ``rescorer`` (``(actor_critic, temperature, runtime)``, None
    to skip this iteration) rescores the first ``ppo.sampler_gap_rows`` rows of every rank."""
    if generated.logprobs is None:
        return {}
    mask = batch.response_mask
    if ppo.old_logprobs == "rescore":
        metrics = sampler_gap(generated.logprobs, batch.old_logprobs, mask, all_ranks)
    elif rescorer is not None:
        actor_critic, temperature, runtime = rescorer
        few = _first_rows(generated, ppo.sampler_gap_rows)
        size = ppo.scoring_batch_size or ppo.micro_batch_size
        scored = score_in_chunks(actor_critic, few, temperature, runtime, size, with_values=False)
        assert few.logprobs is not None
        metrics = sampler_gap(few.logprobs, scored.logprobs, few.response_mask, all_ranks)
    else:
        return {}
    if batch.importance_weights is not None:
        weight = RunningMean.from_masked(batch.importance_weights, mask)
        metrics["rollout/tis_weight"] = (weight.all_reduce() if all_ranks else weight).item()
    return metrics


def _first_rows(generated: GeneratedBatch, rows: int) -> GeneratedBatch:
    """The batch's first ``rows`` rows (every field cut alike)."""
    return dataclasses.replace(
        generated,
        **{
            field.name: getattr(generated, field.name)[:rows]
            for field in dataclasses.fields(generated)
            if getattr(generated, field.name) is not None
        },
    )


class SamplerGapWarning(UserWarning):
    """The sampler's log-probabilities of the sampled tokens are far from the trainer's."""


class SamplerGapWatch:
    """Warns once per run when ``rollout/sampler_gap_mean`` passes ``ppo.sampler_gap_warn``,
    naming the likely causes and the keys."""

    def __init__(self, ppo: PPOConfig, generation: GenerationConfig, precision: str) -> None:
        self.bound = ppo.sampler_gap_warn
        self.ppo, self.generation, self.precision = ppo, generation, precision
        self.warned = False

    def check(self, iteration: int, metrics: dict[str, float]) -> None:
        gap = metrics.get("rollout/sampler_gap_mean")
        if self.warned or self.bound is None or gap is None or gap <= self.bound:
            return
        self.warned = True
        causes = []
        if self.precision == "bf16":
            causes.append(
                "bf16 sampling against the trainer's rescoring (precision=bf16); "
                "ppo.tis_cap corrects for it"
            )
        if self.generation.engine == "vllm" and (
            self.generation.top_k or self.generation.top_p < 1.0
        ):
            causes.append(
                "generation.top_k/top_p on the vLLM engine, whose log-probabilities describe "
                "the truncated distribution"
            )
        causes.append("a sampler and trainer that do not see the same model or tokens (a bug)")
        mode = (
            " With ppo.old_logprobs=sampling the update takes the sampler's numbers as the old "
            "policy's: ppo.old_logprobs=rescore uses the trainer's."
            if self.ppo.old_logprobs == "sampling"
            else ""
        )
        warnings.warn(
            f"rollout/sampler_gap_mean={gap:.3g} nats per token at iteration {iteration} is over "
            f"ppo.sampler_gap_warn={self.bound:g} (largest "
            f"{metrics.get('rollout/sampler_gap_max', float('nan')):.3g}): the sampler's "
            "log-probabilities of the sampled tokens are not the trainer's. Likely: "
            f"{'; '.join(causes)}.{mode} Warned once per run.",
            SamplerGapWarning,
            stacklevel=2,
        )


def _value_head_for_sampling(
    actor_critic: ActorCritic, ppo: PPOConfig, engine: VLLMEngine | None
) -> torch.nn.Module | None:
    """The value head the sampling loop applies as it samples, so that with
    ``ppo.old_logprobs=sampling`` the policy needs no scoring pass: the shared one (on the
    policy's trunk) under the loop; None for a separate critic (a trunk the loop does not run),
    the critic-free estimators and the vLLM engine (which gives no hidden states)."""
    if ppo.old_logprobs != "sampling" or engine is not None or actor_critic.critic is not None:
        return None
    return actor_critic.value_head


def _score_with_both(
    actor_critic: ActorCritic,
    reference: torch.nn.Module,
    generated: GeneratedBatch,
    temperature: float,
    runtime: Runtime,
    ppo: PPOConfig,
) -> tuple[ScoredBatch, ScoredBatch]:
    """The sampled responses scored by the policy (log-probabilities, values when it has a
    critic) and by the reference, in gradient-free passes of ``ppo.scoring_batch_size`` rows
    (``ppo.micro_batch_size`` when unset). With ``ppo.old_logprobs=sampling`` the policy's
    log-probabilities are those the sampler kept, and its pass runs only for a critic whose
    values the sampling loop did not give (:func:`_value_head_for_sampling`), computing those
    alone."""
    size = ppo.scoring_batch_size or ppo.micro_batch_size
    sampled = generated.logprobs if ppo.old_logprobs == "sampling" else None
    if sampled is not None and (not actor_critic.has_critic or generated.values is not None):
        policy_scored = ScoredBatch(logprobs=sampled, values=generated.values, entropy=None)
    else:  # with the sampler's log-probabilities the pass computes the values alone
        policy_scored = score_in_chunks(
            actor_critic, generated, temperature, runtime, size, actor_critic.has_critic, sampled
        )
    reference_scored = score_in_chunks(
        reference, generated, temperature, runtime, size, with_values=False
    )
    return policy_scored, reference_scored


def _advantages(
    ppo: PPOConfig,
    scores: Tensor,
    token_kl: Tensor,
    reward_kl_coef: float,
    rewards: Tensor,
    mask: Tensor,
    values: Tensor | None,
    all_ranks: bool,
) -> tuple[Tensor, Tensor | None]:
    """``(advantages, returns)`` of ``ppo.advantage_estimator`` for this rank's rows, whose
    groups of ``ppo.samples_per_prompt`` consecutive rows are whole here."""
    # The group estimators compare whole responses: each one's return is its score minus the
    # KL penalty of all its tokens (the sum of its per-token rewards), as in RLOO's paper.
    sequence_returns = scores - reward_kl_coef * masked_sum(token_kl, mask, dim=1)
    return ESTIMATORS[ppo.advantage_estimator](
        AdvantageInputs(
            scores=sequence_returns,
            rewards=rewards,
            response_mask=mask,
            gamma=ppo.gamma,
            lam=ppo.lam,
            values=values,
            group_ids=consecutive_groups(len(scores), ppo.samples_per_prompt, mask.device),
            whiten=ppo.whiten_advantages,
            all_ranks=all_ranks,
        )
    )


def _rollout_metrics(
    batch: RolloutBatch, raw_scores: Tensor, token_kl: Tensor, has_eos: Tensor, all_ranks: bool
) -> dict[str, float]:
    """Per-sequence means of score, KL, reward, length and EOS rate (over every rank's rows with
    ``all_ranks``), the token-weighted value mean (with a critic) and the score's standard
    deviation."""
    mask = batch.response_mask
    per_sequence = {
        "rollout/score": raw_scores,
        "rollout/positive_rate": (raw_scores > POSITIVE_SCORE).float(),
        "rollout/kl": masked_sum(token_kl, mask, dim=1),
        "rollout/reward": masked_sum(batch.rewards, mask, dim=1),
        "rollout/response_length": mask.sum(dim=1).float(),
        "rollout/eos_rate": has_eos.float(),
    }
    means = {name: RunningMean.from_sum(v.sum(), len(v)) for name, v in per_sequence.items()}
    if batch.old_values is not None:
        means["rollout/value_mean"] = RunningMean.from_masked(batch.old_values, mask)
    metrics = {name: (m.all_reduce() if all_ranks else m).item() for name, m in means.items()}
    every_row = torch.ones_like(raw_scores, dtype=torch.bool)
    metrics["rollout/score_std"] = (
        float(masked_moments(raw_scores, every_row, all_ranks=all_ranks)[1]) ** 0.5
        if len(raw_scores) > 1 or all_ranks
        else 0.0
    )
    return metrics


def sampler_gap(
    sampler_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor, all_ranks: bool = False
) -> dict[str, float]:
    """How far the sampler's log-probabilities of the sampled tokens (the loop's or the vLLM
    engine's) are from the trainer's rescoring of them, over the response tokens of ``mask``
    ``[B, T]``: the mean and largest absolute difference and the per-token KL estimate
    ``k3 = exp(r) - 1 - r``, ``r = trainer - sampler`` (Schulman 2020, "Approximating KL
    divergence"; unbiased for KL(sampler || trainer), the tokens being the sampler's draws)."""
    gap = (trainer_logprobs - sampler_logprobs).float()
    tokens = mask.float()
    k3 = (torch.expm1(gap) - gap) * tokens
    means = {
        "rollout/sampler_gap_mean": RunningMean.from_masked(gap.abs(), mask),
        "rollout/sampler_kl": RunningMean.from_masked(k3, mask),
    }
    metrics = {name: (m.all_reduce() if all_ranks else m).item() for name, m in means.items()}
    largest = (gap.abs() * tokens).max() if tokens.numel() else gap.new_zeros(())
    if all_ranks:
        import torch.distributed as dist

        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    metrics["rollout/sampler_gap_max"] = float(largest.detach())
    return metrics
