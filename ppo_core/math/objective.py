"""The PPO objective of one micro-batch: policy loss + value loss - entropy bonus, aggregated.

Per token ``i`` (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 9, with the
clipped value loss of OpenAI's baselines ``ppo2``):

    l_i = pg_i + vf_coef * vf_i - entropy_coef * H_i + kl_coef * kl_i

The value term is absent without a critic (the critic-free advantage estimators); the KL term
is there only when the KL enters the loss instead of the reward (``kl.in_loss``, as GRPO does:
Shao et al. 2024, "DeepSeekMath", eq. 3), ``kl_i`` the per-token estimate of
:func:`~ppo_core.math.kl.kl_penalty` between the current policy and the reference.

reduced by :func:`~ppo_core.math.losses.aggregate_loss` to a (sum, count) pair, never a mean, so
that micro-batches and ranks add up to the exact mini-batch objective (docs/design.md section 4).
This is the one definition the trainer, the tests and the benchmarks share.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ppo_core.math.declarations import DEFAULT_KL_ESTIMATOR, KLEstimator, ObjectiveCoefficients
from ppo_core.math.kl import kl_penalty
from ppo_core.math.losses import (
    LossParts,
    aggregate_loss,
    count_units,
    policy_loss,
    value_loss,
)
from ppo_core.math.running_mean import RunningMean

__all__ = ["PPOObjective"]


@dataclass(frozen=True)
class PPOObjective(ObjectiveCoefficients):
    """The coefficients of the PPO objective; calling it scores one micro-batch.

    Attributes (the defaults of the first seven are ``ObjectiveCoefficients``', which the
    ``ppo`` config section shares):
        clip_eps: lower policy clip range, ``rho >= 1 - clip_eps``.
        clip_eps_high: upper clip range, ``rho <= 1 + clip_eps_high``; ``None`` uses ``clip_eps``.
        dual_clip: dual-clip constant ``c > 1`` for negative advantages; ``None`` is off.
        clip_eps_value: value clip range around the rollout values; ``None`` is off.
        vf_coef: weight of the value loss.
        entropy_coef: weight of the entropy bonus (subtracted).
        loss_agg_mode: how token losses reduce to units (see ``aggregate_loss``).
        kl_coef: weight of the KL term in the loss; 0 leaves it out (the KL is then in the
            reward, or nowhere).
        kl_estimator: which per-token KL estimate that term uses (``kl.estimator``'s default).
    """

    kl_coef: float = 0.0
    kl_estimator: KLEstimator = DEFAULT_KL_ESTIMATOR

    def __call__(
        self,
        logprobs: Tensor,
        values: Tensor | None,
        entropy: Tensor | None,
        old_logprobs: Tensor,
        old_values: Tensor | None,
        advantages: Tensor,
        returns: Tensor | None,
        response_mask: Tensor,
        ref_logprobs: Tensor | None = None,
        importance_weights: Tensor | None = None,
    ) -> tuple[LossParts, dict[str, RunningMean]]:
        """This micro-batch's share of the mini-batch objective, and its statistics.

        Args:
            logprobs: ``[B, T]`` current log-probabilities of the taken tokens (with graph).
            values: ``[B, T]`` current value predictions (with graph); ``None`` without a
                critic, together with ``old_values`` and ``returns``: no value term.
            entropy: ``[B, T]`` per-token policy entropy, or ``None``; it needs a graph only when
                ``entropy_coef > 0``, and is then required.
            old_logprobs, old_values: ``[B, T]`` the same at rollout time.
            advantages, returns: ``[B, T]`` from GAE (advantages whitened per rollout batch).
            response_mask: ``[B, T]`` True on tokens that count; masked positions may hold
                anything, NaN included.
            ref_logprobs: ``[B, T]`` the reference's log-probabilities, needed when
                ``kl_coef > 0``.
            importance_weights: ``[B, T]`` truncated importance-sampling weights of the
                sampler's draws (:func:`~ppo_core.math.losses.truncated_importance_weights`),
                multiplying each token's policy loss; ``None`` weighs every token 1.

        Returns:
            ``(LossParts(sum, count), stats)``; every statistic is a token-weighted
            :class:`RunningMean`: ``policy_loss``, ``value_loss``, ``approx_kl``, ``clipfrac``,
            ``ratio``, ``vf_clipfrac`` (the two value ones only with a critic), plus ``entropy``
            when given, ``dual_clipfrac`` when dual clipping is on and ``kl_loss`` (the mean
            per-token KL estimate) when ``kl_coef > 0``.
        """
        if self.entropy_coef > 0 and entropy is None:
            raise ValueError(f"entropy_coef={self.entropy_coef} needs the per-token entropy")
        if self.kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"kl_coef={self.kl_coef} needs the reference's logprobs")
        if (values is None) != (old_values is None) or (values is None) != (returns is None):
            raise ValueError("values, old_values and returns are given together or not at all")
        pg = policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            response_mask,
            self.clip_eps,
            self.clip_eps_high,
            self.dual_clip,
        )
        token_losses = pg.token_losses
        if importance_weights is not None:
            token_losses = token_losses * importance_weights
        stats = {
            "policy_loss": RunningMean.from_masked(pg.token_losses.detach(), response_mask),
            "approx_kl": pg.approx_kl,
            "clipfrac": pg.clipfrac,
            "ratio": pg.ratio,
        }
        if values is not None and old_values is not None and returns is not None:
            vf = value_loss(values, old_values, returns, response_mask, self.clip_eps_value)
            token_losses = token_losses + self.vf_coef * vf.token_losses
            stats["value_loss"] = RunningMean.from_masked(vf.token_losses.detach(), response_mask)
            stats["vf_clipfrac"] = vf.clipfrac
        if self.entropy_coef > 0 and entropy is not None:
            token_losses = token_losses - self.entropy_coef * entropy
        if self.kl_coef > 0 and ref_logprobs is not None:
            token_kl = kl_penalty(logprobs, ref_logprobs, self.kl_estimator, response_mask)
            token_losses = token_losses + self.kl_coef * token_kl
            stats["kl_loss"] = RunningMean.from_masked(token_kl.detach(), response_mask)
        parts = aggregate_loss(token_losses, response_mask, self.loss_agg_mode)
        if entropy is not None:
            stats["entropy"] = RunningMean.from_masked(entropy.detach(), response_mask)
        if self.dual_clip is not None:
            stats["dual_clipfrac"] = pg.dual_clipfrac
        return parts, stats

    def count(self, response_mask: Tensor) -> Tensor:
        """Units a ``[B, T]`` mask contributes to the denominator ``N`` (no forward pass)."""
        return count_units(response_mask, self.loss_agg_mode)
