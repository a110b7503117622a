"""The string choices of the configuration: each key whose value is one of a fixed set of
strings, with those strings (:data:`CHOICES`), and the ``Choice[...]`` annotation its field
carries in the schema."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, get_args

from ppo_core.math.choices import ADVANTAGE_ESTIMATORS, KLEstimator, LossAggMode

# The string choices owned here; the loss aggregation modes and KL estimators are defined by the
# math functions that take them.
Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16"]
Critic = Literal["shared", "separate", "none"]
OptimizerName = Literal["adamw", "sgd"]
SchedulerName = Literal["constant", "linear"]
StrategyName = Literal["ddp", "fsdp"]
ExportType = Literal["f32", "f16", "q8_0"]
OldLogprobs = Literal["rescore", "sampling"]

# A field annotated ``Choice[SomeLiteral]`` is that Literal to a type checker and ``str`` to
# OmegaConf: OmegaConf 2.3 has no Literal fields (and matches an Enum by member name, which
# "token-mean" cannot be). validate_config checks the value against CHOICES.
if TYPE_CHECKING:
    _T = TypeVar("_T")
    Choice = Annotated[_T, "choice"]
else:

    class _ChoiceOfStr:
        def __getitem__(self, choices: Any) -> type:
            return str

    Choice = _ChoiceOfStr()


# Every key whose value is one of a fixed set of strings, with those strings (a Literal's, or the
# registry of advantage estimators).
CHOICES: dict[str, tuple[str, ...]] = {
    "device": get_args(Device),
    "precision": get_args(Precision),
    "model.critic": get_args(Critic),
    "model.reference_dtype": get_args(Precision),
    "base.dtype": get_args(Precision),
    "ppo.loss_agg_mode": get_args(LossAggMode),
    "ppo.advantage_estimator": ADVANTAGE_ESTIMATORS,
    "ppo.old_logprobs": get_args(OldLogprobs),
    "kl.estimator": get_args(KLEstimator),
    "optim.name": get_args(OptimizerName),
    "optim.scheduler": get_args(SchedulerName),
    "parallel.strategy": get_args(StrategyName),
    "export.type": get_args(ExportType),
}
