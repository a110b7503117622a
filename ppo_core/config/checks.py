"""The checks of a loaded configuration (layer 3): ranges and upper bounds, choices, the
nesting of batch sizes, where outputs may be written, and the rules across keys (estimator and
critic, LoRA and the reference)."""

from __future__ import annotations

import math
import os
import re
import zoneinfo
from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import Any, get_args

from ppo_core.config.keys import MAX_VALUE_CHARS, ConfigError, flatten, shown_value
from ppo_core.config.schema import CHOICES, Config, ModelConfig, PPOConfig
from ppo_core.math.choices import (
    check_batch_sizes,
    needs_critic,
    needs_groups,
)


def _choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}={shown_value(value)} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float | int, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


_BATCH_ROWS = 1_000_000
_ITERATIONS = 100_000_000
_TOKENS = 1_000_000
_ROWS = 1_000_000_000
# Seeds: torch takes 64-bit ones; a larger integer (a flow run's `params`, a YAML file) would
# overflow in the middle of a run.
_SEED = 2**63 - 1
# Upper bounds of every integer key: sizes, counts and lengths far above any real run, so that
# only a slip (a few zeros too many) meets them, and it fails here, naming the key, instead of
# allocating for hours or running out of memory in the middle of a run; seeds within 64 bits.
UPPER_BOUNDS: dict[str, int] = {
    "seed": _SEED,
    "base.tiny_seed": _SEED,
    "data.split_seed": _SEED,
    "eval.seed": _SEED,
    "threads": 4096,
    "base.tiny_steps": 10_000_000,
    "model.lora.rank": 65_536,
    "data.max_rows_per_file": _ROWS,
    "data.max_bytes_per_file": 1 << 40,
    "validation.min_tokens": _TOKENS,
    "validation.max_tokens": _TOKENS,
    "validation.min_train_rows": _ROWS,
    "validation.min_eval_rows": _ROWS,
    "ppo.rollout_batch_size": _BATCH_ROWS,
    "ppo.mini_batch_size": _BATCH_ROWS,
    "ppo.micro_batch_size": _BATCH_ROWS,
    "ppo.generation_batch_size": _BATCH_ROWS,
    "ppo.scoring_batch_size": _BATCH_ROWS,
    "ppo.samples_per_prompt": _BATCH_ROWS,
    "ppo.epochs": 10_000,
    "kl.horizon": 10**12,
    "optim.warmup_iterations": _ITERATIONS,
    "generation.max_new_tokens": _TOKENS,
    "generation.top_k": 100_000_000,
    "train.iterations": _ITERATIONS,
    "train.checkpoint_every": _ITERATIONS,
    "train.keep_checkpoints": 10_000,
    "train.keep_set_aside": 10_000,
    "eval.num_prompts": 10_000_000,
    "eval.samples_per_prompt": 10_000,
    "eval.num_examples": 1_000_000,
}


# Folders and files a run writes or replaces, by config key.
WRITE_KEYS = (
    "data.interim_dir",
    "data.prepared_dir",
    "validation.report_dir",
    "train.output_dir",
    "train.checkpoint_dir",
    "train.metrics_dir",
    "eval.output_dir",
    "promote.production_dir",
    "promote.registry",
    "promote.report",
    "ingest.inbox_dir",
    "ingest.rejected_dir",
)
# Inputs no output may be, sit in or contain (model.policy is written by the base stage only).
READ_KEYS = (
    "model.policy",
    "model.reference",
    "model.lora.adapter",
    "base.source",
    "data.raw_dir",
    "data.train_file",
    "data.eval_file",
)


def check_write_paths(flat: dict[str, Any], write_keys: Sequence[str] = WRITE_KEYS) -> None:
    """Write targets stay where they are meant to be; raise :class:`ConfigError` otherwise.

    Every output (``write_keys``; the base stage adds ``model.policy``) counts where it really
    is, symbolic links resolved (:mod:`ppo_core.output_paths`). It must lie inside the project
    (the working folder), the system's temporary folder or a folder named in the environment
    variable ``PPO_ALLOWED_OUTPUT_ROOTS`` (several separated by ``:``), and may not be, sit in
    or contain ``.git``, ``.dvc``, ``.venv``, the source folders, ``data/raw`` or the files
    that define the pipeline; a relative path may not climb out of the working folder with
    ``..``. No two outputs may be the same or one inside the other, and none may be, sit
    inside or contain an input the run reads (``READ_KEYS``: the models, the raw data, the
    train and eval files) or the production folder, so that a run cannot replace its own
    inputs or a promoted version. ``flat`` is the config as ``flatten`` gives it.
    """
    from ppo_core.output_paths import OutputPathError, check_output, overlap, real_path

    # Inputs an output holds by design: the prepared version holds the train and eval files,
    # scheduled retraining imports a production version, the reference defaults to the policy.
    by_design = {
        ("base.source", "promote.production_dir"),
        ("data.train_file", "data.prepared_dir"),
        ("data.eval_file", "data.prepared_dir"),
        ("data.train_file", "data.interim_dir"),
        ("data.eval_file", "data.interim_dir"),
        ("model.reference", "model.policy"),
    }
    for key in write_keys:
        if not os.path.isabs(flat[key]) and os.path.normpath(flat[key]).split(os.sep)[0] == "..":
            raise ConfigError(
                f"{key}={str(flat[key])!r} leaves the working folder through '..'; "
                "keep outputs inside the project or give an absolute path"
            )
    try:
        writes = {key: check_output(key, flat[key]) for key in write_keys}
    except OutputPathError as exc:
        raise ConfigError(str(exc)) from None
    keys = list(writes)
    for i, first in enumerate(keys):
        for second in keys[i + 1 :]:
            if overlap(writes[first], writes[second]):
                raise ConfigError(
                    f"{first}={str(flat[first])!r} and {second}="
                    f"{str(flat[second])!r} overlap; each output needs a folder "
                    "of its own"
                )
    for read_key in READ_KEYS:
        value = flat.get(read_key)
        if value is None or ":" in str(value) or read_key in writes or "\0" in str(value):
            continue  # not a folder (builtin:..., module:function), an output, or no path at all
        read = real_path(value)
        for key, path in writes.items():
            if (read_key, key) not in by_design and overlap(path, read):
                raise ConfigError(
                    f"{key}={str(flat[key])!r} would write over {read_key}="
                    f"{value!r}; choose another folder"
                )


# check_batch_sizes names the sizes without their section; the config names them in full.
_PPO_KEY = re.compile(rf"(?<![\w.])({'|'.join(item.name for item in fields(PPOConfig))})\b")


def validate_config(config: Config) -> None:
    """Check ranges, choices and the nesting of batch sizes; raise :class:`ConfigError`."""
    flat = flatten(config)
    for key, value in flat.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        if isinstance(value, str) and len(value) > MAX_VALUE_CHARS:
            raise ConfigError(
                f"{key} must be at most {MAX_VALUE_CHARS} characters long, got {len(value)}"
            )
        if isinstance(value, str) and "${" in value:
            # the text of an escaped \${...}: a saved config would hold it unescaped, and the
            # next load (a resumed run, `ppo evaluate`) would resolve it
            raise ConfigError(
                f"{key} must not hold '${{' (got {shown_value(value)}): a saved config would read "
                "it as a reference"
            )
    for key, bound in UPPER_BOUNDS.items():
        if flat[key] is not None and flat[key] > bound:
            raise ConfigError(f"{key} must be at most {bound}, got {flat[key]}")
    check_write_paths(flat)
    for key, choices in CHOICES.items():
        _choice(key, flat[key], get_args(choices))
    try:
        zoneinfo.ZoneInfo(config.schedule.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a name too long
        raise ConfigError(
            f"schedule.timezone={shown_value(config.schedule.timezone)} is not an IANA time "
            "zone name; use e.g. UTC or Europe/Berlin"
        ) from None
    ppo = config.ppo
    try:
        check_batch_sizes(
            ppo.rollout_batch_size,
            ppo.mini_batch_size,
            ppo.micro_batch_size,
            drop_last=ppo.drop_last,
        )
    except ValueError as exc:
        raise ConfigError(_PPO_KEY.sub(r"ppo.\1", str(exc))) from None
    for key, value in {
        "ppo.epochs": ppo.epochs,
        "ppo.clip_eps": ppo.clip_eps,
        "optim.lr": config.optim.lr,
        "generation.max_new_tokens": config.generation.max_new_tokens,
        "generation.temperature": config.generation.temperature,
        "train.iterations": config.train.iterations,
        "base.tiny_steps": config.base.tiny_steps,
        "validation.max_tokens": config.validation.max_tokens,
        "train.checkpoint_every": config.train.checkpoint_every,
        "train.keep_checkpoints": config.train.keep_checkpoints,
        "eval.num_prompts": config.eval.num_prompts,
        "eval.samples_per_prompt": config.eval.samples_per_prompt,
        "kl.target": config.kl.target,
        "kl.horizon": config.kl.horizon,
    }.items():
        _positive(key, value)
    for key, value in {
        "ppo.vf_coef": ppo.vf_coef,
        "ppo.entropy_coef": ppo.entropy_coef,
        "kl.coef": config.kl.coef,
        "optim.weight_decay": config.optim.weight_decay,
        "optim.warmup_iterations": config.optim.warmup_iterations,
        "generation.top_k": config.generation.top_k,
        "threads": config.threads,
        "eval.num_examples": config.eval.num_examples,
        "train.keep_set_aside": config.train.keep_set_aside,
        "validation.min_tokens": config.validation.min_tokens,
        "validation.min_train_rows": config.validation.min_train_rows,
        "validation.min_eval_rows": config.validation.min_eval_rows,
        "model.reward_timeout": config.model.reward_timeout,
        **{
            f"flow.{name}": value
            for name, value in vars(config.flow).items()
            if name.endswith("_timeout")
        },
    }.items():
        _positive(key, value, allow_zero=True)
    for key, value in {
        "ppo.clip_eps_high": ppo.clip_eps_high,
        "ppo.clip_eps_value": ppo.clip_eps_value,
        "ppo.target_kl": ppo.target_kl,
        "ppo.max_grad_norm": ppo.max_grad_norm,
    }.items():
        if value is not None:
            _positive(key, value)
    if ppo.generation_batch_size is not None and (
        ppo.generation_batch_size < 1 or ppo.rollout_batch_size % ppo.generation_batch_size
    ):
        raise ConfigError(
            f"ppo.generation_batch_size={ppo.generation_batch_size} must be a positive divisor of "
            f"ppo.rollout_batch_size={ppo.rollout_batch_size}"
        )
    if ppo.scoring_batch_size is not None and ppo.scoring_batch_size < 1:
        raise ConfigError(
            f"ppo.scoring_batch_size must be >= 1 (or null), got {ppo.scoring_batch_size}"
        )
    if ppo.dual_clip is not None and ppo.dual_clip <= 1.0:
        raise ConfigError(f"ppo.dual_clip must be > 1 (or null), got {ppo.dual_clip}")
    if not 0.0 <= ppo.gamma <= 1.0:
        raise ConfigError(f"ppo.gamma must be in [0, 1], got {ppo.gamma}")
    if not 0.0 <= ppo.lam <= 1.0:
        raise ConfigError(f"ppo.lam must be in [0, 1], got {ppo.lam}")
    if not 0.0 <= config.promote.min_eos_rate <= 1.0:
        raise ConfigError(
            f"promote.min_eos_rate must be in [0, 1], got {config.promote.min_eos_rate}"
        )
    _positive("promote.max_kl", config.promote.max_kl)
    for key, value in {
        "promote.max_distinct_2_drop": config.promote.max_distinct_2_drop,
        "promote.max_nll_increase": config.promote.max_nll_increase,
        "promote.max_check_drop": config.promote.max_check_drop,
    }.items():
        if value is not None:
            _positive(key, value, allow_zero=True)
    if not 0.0 < config.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in (0, 1), got {config.data.eval_fraction}")
    if not 0.0 < config.generation.top_p <= 1.0:
        raise ConfigError(f"generation.top_p must be in (0, 1], got {config.generation.top_p}")
    if len(config.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in config.optim.betas):
        raise ConfigError(
            f"optim.betas must be two numbers in [0, 1), got {shown_value(config.optim.betas)}"
        )
    _check_lora(config.model)
    _check_estimator(config)
    if config.parallel.reference_offload and config.parallel.strategy != "fsdp":
        raise ConfigError(
            "parallel.reference_offload=true needs parallel.strategy=fsdp (got "
            f"{config.parallel.strategy!r}): only a sharded reference is offloaded"
        )


def _check_estimator(config: Config) -> None:
    """``ppo.advantage_estimator`` against ``model.critic`` and ``ppo.samples_per_prompt``: one
    error naming every key to change."""
    ppo, critic = config.ppo, config.model.critic
    estimator = ppo.advantage_estimator
    if ppo.samples_per_prompt < 1 or ppo.rollout_batch_size % ppo.samples_per_prompt:
        raise ConfigError(
            f"ppo.samples_per_prompt={ppo.samples_per_prompt} must be a positive divisor of "
            f"ppo.rollout_batch_size={ppo.rollout_batch_size} (which counts responses, "
            "each prompt's samples in consecutive rows)"
        )
    problems = []
    if needs_groups(estimator) and ppo.samples_per_prompt < 2:
        problems.append(
            "it compares the samples of each prompt and needs ppo.samples_per_prompt >= 2, got "
            f"ppo.samples_per_prompt={ppo.samples_per_prompt}"
        )
    if needs_critic(estimator) and critic == "none":
        problems.append(
            "it needs a critic, but model.critic=none; set model.critic=shared (or separate), "
            "or choose a critic-free estimator (grpo, dr_grpo, rloo, reinforce_pp)"
        )
    if not needs_critic(estimator) and critic != "none":
        problems.append(
            f"it uses no critic, but model.critic={critic} would build and train one; set "
            "model.critic=none"
        )
    if problems:
        raise ConfigError(f"ppo.advantage_estimator={estimator}: " + "; ".join(problems))


def _check_lora(model: ModelConfig) -> None:
    """The ``model.lora`` keys, and the modes LoRA does not combine with."""
    lora = model.lora
    if not lora.enabled:
        if lora.adapter is not None:
            raise ConfigError(
                f"model.lora.adapter={shown_value(lora.adapter)} needs model.lora.enabled=true"
            )
        return
    if lora.rank < 1:
        raise ConfigError(f"model.lora.rank must be >= 1, got {lora.rank}")
    _positive("model.lora.alpha", lora.alpha)
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    if not lora.target_modules or not all(
        isinstance(name, str) and name.strip() for name in lora.target_modules
    ):
        raise ConfigError(
            "model.lora.target_modules must be a non-empty list of module names (or "
            f"[all-linear]), got {shown_value(lora.target_modules)}"
        )
    if model.critic == "separate":
        raise ConfigError(
            "model.critic=separate is not supported with model.lora.enabled=true: the value "
            "head shares the adapted trunk (model.critic=shared)"
        )
    if model.reference_dtype != "fp32" and model.reference is None:
        raise ConfigError(
            f"model.reference_dtype={model.reference_dtype} has no effect with LoRA and no "
            "model.reference: the reference is the policy's own weights with the adapter off"
        )
