"""The checks of a loaded configuration (layer 3): ranges and upper bounds, choices, the
nesting of batch sizes, where outputs may be written, and the rules across keys (estimator and
critic, LoRA and the reference)."""

from __future__ import annotations

import functools
import math
import os
import re
import zoneinfo
from collections.abc import Iterable, Sequence
from dataclasses import fields, is_dataclass, replace
from typing import Any

from ppo_core.config.bounds import Bounds
from ppo_core.config.choices import CHOICES
from ppo_core.config.keys import MAX_VALUE_CHARS, ConfigError, flatten, shown_value
from ppo_core.config.schema import Config, ModelConfig, PPOConfig
from ppo_core.files.output_paths import OutputPathError, check_output, overlap, real_path
from ppo_core.math.declarations import (
    check_batch_sizes,
    critic_free_estimators,
    needs_critic,
    needs_groups,
)


def _choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}={shown_value(value)} is not one of {', '.join(allowed)}")


def _check_bounds(flat: dict[str, Any]) -> None:
    """Each bounded key within its field's :class:`~ppo_core.config.schema.Bounds`; a null
    one (where the schema allows null) passes."""
    for key, bounds in field_bounds().items():
        value = flat[key]
        if value is None:
            continue
        if bounds.most is not None and value > bounds.most:
            raise ConfigError(f"{key} must be at most {bounds.most}, got {value}")
        if not bounds.holds(value):
            nullable = " (or null)" if bounds.nullable else ""
            why = f": {bounds.why}" if bounds.why else ""
            raise ConfigError(f"{key} must be {bounds.rule()}{nullable}, got {value}{why}")


def _positive(key: str, value: float | int) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value}")


@functools.cache
def field_bounds() -> dict[str, Bounds]:
    """Every bounded key (dotted) of :class:`Config` with its :class:`Bounds`, in schema order."""
    found: dict[str, Bounds] = {}

    def walk(cls: type, prefix: str) -> None:
        for item in fields(cls):
            default = item.default_factory() if callable(item.default_factory) else item.default
            if is_dataclass(default):
                walk(type(default), f"{prefix}{item.name}.")
            elif "bounds" in item.metadata:
                nullable = "None" in str(item.type)  # `float | None`, as the annotation reads
                found[f"{prefix}{item.name}"] = replace(item.metadata["bounds"], nullable=nullable)

    walk(Config, "")
    return found


# The slip guard of every integer key (``most`` in its field's bounds, ``schema.py``).
UPPER_BOUNDS: dict[str, int] = {
    key: bounds.most for key, bounds in field_bounds().items() if bounds.most is not None
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
    "export.dir",
    "ingest.inbox_dir",
    "ingest.feedback_inbox_dir",
    "ingest.rejected_dir",
    "reward_model.output_dir",
    "reward_model.checkpoint_dir",
    "reward_model.versions_dir",
    "reward_model.report_dir",
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
    "data.feedback_dir",
    "reward_model.base",
)


def check_write_paths(flat: dict[str, Any], write_keys: Sequence[str] = WRITE_KEYS) -> None:
    """Write targets stay where they are meant to be; raise :class:`ConfigError` otherwise.

    Every output (``write_keys``; the base stage adds ``model.policy``) counts where it really
    is, symbolic links resolved (:mod:`ppo_core.files.output_paths`). It must lie inside the project
    (the working folder), the system's temporary folder or a folder named in the environment
    variable ``PPO_ALLOWED_OUTPUT_ROOTS`` (several separated by ``:``), and may not be, sit in
    or contain ``.git``, ``.dvc``, ``.venv``, the source folders, ``data/raw`` or the files
    that define the pipeline; a relative path may not climb out of the working folder with
    ``..``. No two outputs may be the same or one inside the other, and none may be, sit
    inside or contain an input the run reads (``READ_KEYS``: the models, the raw data, the
    train and eval files) or the production folder, so that a run cannot replace its own
    inputs or a promoted version. ``flat`` is the config as ``flatten`` gives it.
    """
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
    _check_bounds(flat)
    check_write_paths(flat)
    for key, choices in CHOICES.items():
        _choice(key, flat[key], choices)
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
    if ppo.generation_batch_size is not None and (
        ppo.generation_batch_size < 1 or ppo.rollout_batch_size % ppo.generation_batch_size
    ):
        raise ConfigError(
            f"ppo.generation_batch_size={ppo.generation_batch_size} must be a positive divisor of "
            f"ppo.rollout_batch_size={ppo.rollout_batch_size}"
        )
    if len(config.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in config.optim.betas):
        raise ConfigError(
            f"optim.betas must be two numbers in [0, 1), got {shown_value(config.optim.betas)}"
        )
    _check_lora(config.model)
    _check_reward_weights(config.model)
    _check_estimator(config)
    if ppo.tis_cap is not None and ppo.old_logprobs != "rescore":
        raise ConfigError(
            f"ppo.tis_cap={ppo.tis_cap:g} weighs the trainer's rescored probability of each "
            f"token against the sampler's, and ppo.old_logprobs={ppo.old_logprobs!r} takes the "
            "sampler's as both: set ppo.old_logprobs=rescore, or leave ppo.tis_cap unset"
        )
    if config.parallel.reference_offload and config.parallel.strategy != "fsdp":
        raise ConfigError(
            "parallel.reference_offload=true needs parallel.strategy=fsdp (got "
            f"{config.parallel.strategy!r}): only a sharded reference is offloaded"
        )


def _check_reward_weights(model: ModelConfig) -> None:
    """One weight a reward (``model.reward`` first) or none at all."""
    wanted = 1 + len(model.reward_terms)
    if model.reward_weights and len(model.reward_weights) != wanted:
        raise ConfigError(
            f"model.reward_weights={shown_value(model.reward_weights)} holds "
            f"{len(model.reward_weights)} weights for {wanted} rewards (model.reward and "
            f"{len(model.reward_terms)} of model.reward_terms): give one a reward, model.reward "
            "first, or none to weigh each 1"
        )
    if not all(math.isfinite(w) for w in model.reward_weights):
        raise ConfigError(
            f"model.reward_weights={shown_value(model.reward_weights)} must be finite numbers"
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
            f"or choose a critic-free estimator ({', '.join(critic_free_estimators())})"
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


CODE_FREE_KEYS = (
    *WRITE_KEYS,
    "model.policy",
    "model.reference",
    "model.lora.adapter",
    "data.raw_dir",
)
"""Folders a reward module is never imported from: what the pipeline writes, and the model and
data folders it reads (a model folder is data someone else made)."""


def code_free_folders(config: Any) -> list[str]:
    """The folders of :data:`CODE_FREE_KEYS` that ``config`` sets."""
    flat = flatten(config)
    return [str(flat[key]) for key in CODE_FREE_KEYS if flat.get(key)]
