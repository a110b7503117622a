"""What one run of the Prefect flow may change, and how the change reaches DVC and goes away.

A flow run's ``params`` come from whoever reaches the Prefect API, so they are held to an
allow-list (:data:`RUN_PARAMS`: training settings, never a path, a model, a reward, a
promotion threshold or a timeout), checked as a whole config before anything is written, and
written into ``params.yaml`` only for the length of the run (DVC reads its parameters from
there, and ``dvc.lock`` then records what the outputs were made with). The file is put back as
it was when the run ends, failed or not; a copy beside it (:data:`BACKUP_NAME`) lets the next
run put it back after a run that was killed.

OmegaConf, the config and ruamel.yaml are imported inside the functions that use them:
``python -m flows.pipeline run`` imports this module before it starts its Prefect server
(the early start), and nothing heavy may come first.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ppo_core.files import atomic_write_text

# Settings a run may change: how it trains, not what it reads, writes, runs or promotes.
RUN_PARAMS = frozenset(
    {
        "seed",
        "ppo.rollout_batch_size",
        "ppo.mini_batch_size",
        "ppo.micro_batch_size",
        "ppo.epochs",
        "ppo.clip_eps",
        "ppo.clip_eps_high",
        "ppo.dual_clip",
        "ppo.clip_eps_value",
        "ppo.vf_coef",
        "ppo.entropy_coef",
        "ppo.gamma",
        "ppo.lam",
        "ppo.loss_agg_mode",
        "ppo.whiten_advantages",
        "ppo.target_kl",
        "ppo.max_grad_norm",
        "ppo.missing_eos_penalty",
        "kl.estimator",
        "kl.coef",
        "kl.adaptive",
        "kl.target",
        "kl.horizon",
        "optim.lr",
        "optim.weight_decay",
        "optim.eps",
        "optim.momentum",
        "optim.scheduler",
        "optim.warmup_iterations",
        "generation.max_new_tokens",
        "generation.temperature",
        "generation.top_k",
        "generation.top_p",
        "train.iterations",
        "train.checkpoint_every",
    }
)

# Beside params.yaml while a run holds its own values there: the file as it was, and as the run
# wrote it.
BACKUP_NAME = ".retrain-params.json"


class RunParamsError(ValueError):
    """A flow run's ``params`` hold a key a run may not set, or a value that is not valid."""


def check_run_params(repo_dir: str | Path, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """``params`` checked against :data:`RUN_PARAMS` and, merged into ``params.yaml``, as a whole
    config; returns each value as the config holds it (``"2"`` for an integer key becomes 2).

    Raises :class:`RunParamsError` naming the key, or the config's own error naming the key and
    value (e.g. a ``micro_batch_size`` above ``mini_batch_size``). Reads, never writes.
    """
    from omegaconf import OmegaConf

    from ppo_core.config import CHOICES, load_config

    if not params:
        return {}
    if not isinstance(params, Mapping):
        raise RunParamsError(
            f"params must map keys to values, e.g. {{'ppo.epochs': 2}}; got a {type(params).__name__}"
        )
    for key, value in params.items():
        if key not in RUN_PARAMS:
            shown = str(key)[:60]
            raise RunParamsError(
                f"params: {shown!r} cannot be set by a flow run; a run may set only "
                f"{', '.join(sorted(RUN_PARAMS))}. Other keys are set by editing params.yaml"
            )
        if isinstance(value, str):
            choices = CHOICES.get(key, ())
            if value not in choices:
                raise RunParamsError(
                    f"params: {key} takes a number or true/false, not the string {value[:40]!r}"
                    if not choices
                    else f"params: {key} must be one of {', '.join(choices)}; got {value[:40]!r}"
                )
        elif value is not None and not isinstance(value, bool | int | float):
            raise RunParamsError(
                f"params: {key} must be a number, true/false or null; got a {type(value).__name__}"
            )
    # JSON is YAML: each value reaches OmegaConf as the literal it is, never as a reference.
    config = load_config(
        Path(repo_dir) / "params.yaml",
        overrides=[f"{key}={json.dumps(value)}" for key, value in params.items()],
    )
    checked = {key: OmegaConf.select(OmegaConf.structured(config), key) for key in params}
    for key, value in params.items():
        if isinstance(value, bool) != isinstance(checked[key], bool):
            raise RunParamsError(
                f"params: {key} must be a {type(checked[key]).__name__}; got {value!r}"
            )
    return checked


def set_params(repo_dir: str | Path, updates: Mapping[str, Any]) -> None:
    """Set dotted keys in params.yaml, keeping its comments (as `dvc exp run -S` does); the file
    is replaced atomically."""
    from ruamel.yaml import YAML

    yaml = YAML()
    path = Path(repo_dir) / "params.yaml"
    data = yaml.load(path.read_text())
    for dotted, value in updates.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        if leaf not in node:
            raise KeyError(f"params.yaml has no key {dotted!r}")
        node[leaf] = value
    text = io.StringIO()
    yaml.dump(data, text)
    atomic_write_text(path, text.getvalue())


def put_back_left_params(repo_dir: str | Path) -> str | None:
    """Put ``params.yaml`` back as it was before a run that ended without doing so (killed),
    unless it was edited since; returns what happened, for the log, or None when no run left
    its values there. Call it only while holding the retraining lock."""
    backup = Path(repo_dir) / BACKUP_NAME
    if not backup.is_file():
        return None
    saved = json.loads(backup.read_text())
    if saved["written"] is None:  # killed before it replaced params.yaml
        backup.unlink()
        return None
    message = _put_back(Path(repo_dir) / "params.yaml", saved["original"], saved["written"])
    backup.unlink()
    return f"an earlier run ended before it could restore params.yaml: {message}"


def _put_back(path: Path, original: str, written: str) -> str:
    if path.read_text() != written:
        return (
            "params.yaml was edited while the run held its own values there; it is left as it "
            "is, and the run's values may still be in it"
        )
    atomic_write_text(path, original)
    return "params.yaml is back as it was"


@contextmanager
def params_for_this_run(repo_dir: str | Path, updates: Mapping[str, Any]) -> Iterator[None]:
    """``params.yaml`` with ``updates`` for the length of the ``with`` block, then as it was
    (unless someone edited it meanwhile: then it is left alone and the log says so).
    ``updates`` must have been checked (:func:`check_run_params`)."""
    if not updates:
        yield
        return
    path = Path(repo_dir) / "params.yaml"
    backup = Path(repo_dir) / BACKUP_NAME
    original = path.read_text()
    written: str | None = None  # what this run wrote, once params.yaml is replaced
    atomic_write_text(backup, json.dumps({"original": original, "written": None}))
    try:
        set_params(repo_dir, updates)
        written = path.read_text()
        atomic_write_text(backup, json.dumps({"original": original, "written": written}))
        yield
    finally:
        message = None if written is None else _put_back(path, original, written)
        backup.unlink()
        if message is not None and not message.endswith("as it was"):
            print(f"warning: {message}")
