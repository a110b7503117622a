"""The string choices of the configuration: each key whose value is one of a fixed set of
strings, with those strings (:data:`CHOICES`), and the ``Choice[...]`` annotation its field
carries in the schema."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, get_args

from ppo_core.math.declarations import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES

# The string choices owned here; the advantage estimators, loss aggregation modes and KL estimators
# are the math layer's catalogs (ppo_core/math/declarations.py).
Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16"]
RunPrecision = Literal["auto", "fp32", "bf16"]
Critic = Literal["shared", "separate", "none"]
OptimizerName = Literal["adamw", "sgd"]
SchedulerName = Literal["constant", "linear"]
StrategyName = Literal["ddp", "fsdp"]
ExportType = Literal["f32", "f16", "q8_0"]
OldLogprobs = Literal["rescore", "sampling"]
GenerationEngine = Literal["loop", "vllm"]

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


# Every key whose value is one of a fixed set of strings, with those strings (a Literal's, or a
# catalog's names).
CHOICES: dict[str, tuple[str, ...]] = {
    "device": get_args(Device),
    "precision": get_args(RunPrecision),
    "model.critic": get_args(Critic),
    "model.reference_dtype": get_args(Precision),
    "base.dtype": get_args(Precision),
    "ppo.loss_agg_mode": LOSS_AGG_MODES,
    "ppo.advantage_estimator": ADVANTAGE_ESTIMATORS,
    "ppo.old_logprobs": get_args(OldLogprobs),
    "generation.engine": get_args(GenerationEngine),
    "kl.estimator": KL_ESTIMATORS,
    "optim.name": get_args(OptimizerName),
    "optim.scheduler": get_args(SchedulerName),
    "parallel.strategy": get_args(StrategyName),
    "export.type": get_args(ExportType),
}
