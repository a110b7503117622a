"""The math layer's named choices and batch-size rule, in plain Python.

The config (layer 3) checks these when it loads, before any tensor exists; keeping them free of
torch lets the orchestration process (the Prefect flow, ``ppo ingest``, ``ppo config``) load and
check a config without importing torch, which costs seconds a run (docs/benchmarks.md,
"Orchestration overhead"). The modules that use them import them from here; none re-exports
them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, get_args

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DEFAULT_KL_ESTIMATOR",
    "ESTIMATOR_NEEDS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdvantageEstimator",
    "EstimatorNeeds",
    "KLEstimator",
    "LossAggMode",
    "ObjectiveCoefficients",
    "check_batch_sizes",
    "critic_free_estimators",
    "declared_estimators",
    "needs_critic",
    "needs_groups",
]


class EstimatorNeeds(NamedTuple):
    """What an advantage estimator reads besides the scores."""

    critic: bool
    """The critic's values (a value model is built, run and trained)."""
    groups: bool
    """The other samples of the same prompt (at least 2 a prompt)."""


def declared_estimators(source: str) -> dict[str, EstimatorNeeds]:
    """Each advantage estimator that ``source`` (the text of a module) registers with
    ``@estimator("name", critic=..., groups=...)``, in the order they are written.

    Read from the text, not imported: ``ppo_core.math.advantages`` imports torch, and the config
    checks its choices in processes that must not (the Prefect flow, ``ppo ingest``).

    Raises:
        ValueError: a registration whose arguments are not literals.
    """
    found: dict[str, EstimatorNeeds] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            call = decorator
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "estimator"):
                continue
            try:
                name = ast.literal_eval(call.args[0])
                needs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
                found[name] = EstimatorNeeds(critic=needs["critic"], groups=needs["groups"])
            except (IndexError, KeyError, ValueError) as error:
                raise ValueError(
                    f"@estimator on {node.name} must name the estimator and give critic= and "
                    f"groups= as literals: {ast.unparse(call)}"
                ) from error
    return found


ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = declared_estimators(
    Path(__file__).with_name("advantages.py").read_text(encoding="utf-8")
)
"""Each advantage estimator of ``ppo_core.math.advantages`` with what it needs: the config's
choices and checks and the CLI's help read it."""

ADVANTAGE_ESTIMATORS: tuple[str, ...] = tuple(ESTIMATOR_NEEDS)
AdvantageEstimator = str
"""A name of :data:`ADVANTAGE_ESTIMATORS` (a registry, so not a Literal)."""


def critic_free_estimators() -> tuple[str, ...]:
    """The estimators that need no critic, in their order of registration."""
    return tuple(name for name, needs in ESTIMATOR_NEEDS.items() if not needs.critic)


def needs_critic(estimator: str) -> bool:
    """Whether an advantage estimator reads the critic's values (only ``gae`` does)."""
    return ESTIMATOR_NEEDS[estimator].critic


def needs_groups(estimator: str) -> bool:
    """Whether an advantage estimator compares the samples of one prompt (at least 2 each)."""
    return ESTIMATOR_NEEDS[estimator].groups


# KL(pi || ref) estimators of Schulman (2020), "Approximating KL divergence" (ppo_core.math.kl).
KLEstimator = Literal["k1", "k2", "k3", "abs"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

# How token losses reduce to one loss (ppo_core.math.losses.aggregate_loss).
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


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
