"""What the math layer declares, read without torch: its three catalogs (advantage estimators,
KL estimators, loss aggregation modes), the objective's coefficients and the batch-size rule.

The config (layer 3) checks these when it loads, before any tensor exists; keeping them free of
torch lets the orchestration process (the Prefect flow, ``ppo ingest``, ``ppo config``) load and
check a config without importing torch, which costs seconds a run (docs/benchmarks.md,
"Orchestration overhead"). Each catalog reads its names from its home's text
(:class:`ppo_core.catalog.Catalog`); the home registers the functions under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ppo_core.catalog import Catalog

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_ESTIMATOR_CATALOG",
    "DEFAULT_KL_ESTIMATOR",
    "ESTIMATOR_NEEDS",
    "KL_ESTIMATORS",
    "KL_ESTIMATOR_CATALOG",
    "LOSS_AGGREGATION_CATALOG",
    "LOSS_AGG_MODES",
    "AdvantageEstimator",
    "EstimatorNeeds",
    "KLEstimator",
    "LossAggMode",
    "ObjectiveCoefficients",
    "check_batch_sizes",
    "critic_free_estimators",
    "needs_critic",
    "needs_groups",
]

_HERE = Path(__file__).parent

ADVANTAGE_ESTIMATOR_CATALOG: Catalog = Catalog(
    "advantage estimator", _HERE / "advantages.py", "estimator", traits=("critic", "groups")
)
"""``ppo.advantage_estimator``: ``@estimator("name", critic=..., groups=...)`` in
``ppo_core/math/advantages.py``."""

KL_ESTIMATOR_CATALOG: Catalog = Catalog("KL estimator", _HERE / "kl.py", "kl_estimator")
"""``kl.estimator``: ``@kl_estimator("name")`` in ``ppo_core/math/kl.py``, Schulman (2020),
"Approximating KL divergence"."""

LOSS_AGGREGATION_CATALOG: Catalog = Catalog(
    "loss aggregation mode", _HERE / "losses.py", "loss_aggregation"
)
"""``ppo.loss_agg_mode``: ``@loss_aggregation("name")`` on a class of ``ppo_core/math/losses.py``
that owns both the count of units and their total."""


class EstimatorNeeds(NamedTuple):
    """What an advantage estimator reads besides the scores."""

    critic: bool
    """The critic's values (a value model is built, run and trained)."""
    groups: bool
    """The other samples of the same prompt (at least 2 a prompt)."""


ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = {
    name: EstimatorNeeds(**traits) for name, traits in ADVANTAGE_ESTIMATOR_CATALOG.declared.items()
}
"""Each advantage estimator of ``ppo_core.math.advantages`` with what it needs: the config's
choices and checks and the CLI's help read it."""

ADVANTAGE_ESTIMATORS: tuple[str, ...] = ADVANTAGE_ESTIMATOR_CATALOG.names()
KL_ESTIMATORS: tuple[str, ...] = KL_ESTIMATOR_CATALOG.names()
LOSS_AGG_MODES: tuple[str, ...] = LOSS_AGGREGATION_CATALOG.names()
# Names of the catalogs above (open sets, so not Literals).
AdvantageEstimator = str
KLEstimator = str
LossAggMode = str


def critic_free_estimators() -> tuple[str, ...]:
    """The estimators that need no critic, in their order of registration."""
    return tuple(name for name, needs in ESTIMATOR_NEEDS.items() if not needs.critic)


def needs_critic(estimator: str) -> bool:
    """Whether an advantage estimator reads the critic's values (only ``gae`` does)."""
    return ESTIMATOR_NEEDS[estimator].critic


def needs_groups(estimator: str) -> bool:
    """Whether an advantage estimator compares the samples of one prompt (at least 2 each)."""
    return ESTIMATOR_NEEDS[estimator].groups


@dataclass(frozen=True)
class ObjectiveCoefficients:
    """The coefficients of the PPO objective, with their defaults: the one definition that
    ``ppo_core.math.objective.PPOObjective`` extends and the ``ppo`` config section reads its
    defaults from (the meaning of each: ``PPOObjective``)."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    clip_eps_value: float | None = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    loss_agg_mode: LossAggMode = "token-mean"


DEFAULT_KL_ESTIMATOR: KLEstimator = "k1"
"""The per-token KL estimate of ``kl.estimator`` and of ``PPOObjective.kl_estimator``."""


def check_batch_sizes(
    rollout_batch_size: int, mini_batch_size: int, micro_batch_size: int, drop_last: bool = False
) -> None:
    """Check ``rollout_batch_size >= mini_batch_size >= micro_batch_size >= 1`` and divisibility.

    Raises:
        ValueError: naming the sizes, when they do not nest or do not divide.
    """
    names = {
        "rollout_batch_size": rollout_batch_size,
        "mini_batch_size": mini_batch_size,
        "micro_batch_size": micro_batch_size,
    }
    for name, value in names.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if mini_batch_size > rollout_batch_size:
        raise ValueError(
            f"mini_batch_size={mini_batch_size} is larger than rollout_batch_size="
            f"{rollout_batch_size}; sizes must nest rollout >= mini >= micro"
        )
    if micro_batch_size > mini_batch_size:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} is larger than mini_batch_size="
            f"{mini_batch_size}; sizes must nest rollout >= mini >= micro"
        )
    if mini_batch_size % micro_batch_size:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} does not divide mini_batch_size="
            f"{mini_batch_size}; choose a divisor (e.g. "
            f"{_largest_divisor_at_most(mini_batch_size, micro_batch_size)})"
        )
    if rollout_batch_size % mini_batch_size and not drop_last:
        raise ValueError(
            f"mini_batch_size={mini_batch_size} does not divide rollout_batch_size="
            f"{rollout_batch_size} ({rollout_batch_size % mini_batch_size} rows would be left "
            "over); choose a divisor or set drop_last to drop them every epoch"
        )


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)
