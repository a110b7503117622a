"""The frame of the ``ppo`` command: its Typer app, the options every subcommand shares, how
a config is loaded and how the errors users can fix reach them (one line, exit code 2).

Every subcommand reads ``./params.yaml`` when there is one (``--config FILE`` for another YAML
file, ``--config none`` for the built-in defaults alone) and takes ``key=value`` overrides of any
config key, e.g. ``ppo train ppo.mini_batch_size=32 optim.lr=1e-4``.

Help texts are Markdown (``rich_markup_mode="markdown"``): the terminal rewraps paragraphs to
its width, so a docstring's own line breaks do not show, and a list keeps one item a line.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    name="ppo",
    help=(
        "PPO retraining pipeline for causal language models.\n\n"
        "Stages, in order: prepare (clean and split the raw prompts), base (import or build the "
        "starting model), validate (Great Expectations; publishes the data version), train "
        "(PPO), evaluate (candidate vs baseline), promote (gate to production). `dvc repro` "
        "runs them all; so does the Prefect flow (`python -m flows.pipeline`).\n\n"
        "Every command reads ./params.yaml when there is one (`--config FILE` for another file, "
        "`--config none` for the built-in defaults alone) and takes key=value overrides; "
        "`ppo config --docs` lists every key with what it does."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
# soft_wrap: in a log (DVC, Prefect) a line is not cut at 80 columns mid-path.
console = Console(stderr=True, soft_wrap=True)

# Read when no --config is given, as `dvc repro` reads it for every stage.
DEFAULT_CONFIG = Path("params.yaml")
# The --config value that asks for the built-in defaults alone.
NO_CONFIG = "none"

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help=(
            "YAML config file; keys it leaves out keep their defaults. Without this option "
            f"./{DEFAULT_CONFIG} is read when it exists; `--config {NO_CONFIG}` uses the built-in "
            "defaults alone."
        ),
        show_default=False,
    ),
]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        help="Config overrides as key=value, e.g. ppo.epochs=2 optim.lr=1e-4.", show_default=False
    ),
]


def _config_file(given: Path | None) -> Path | None:
    """The file to read: ``given``, ./params.yaml when none is given, or none at all."""
    if given is not None:
        return None if str(given) == NO_CONFIG else given
    if not DEFAULT_CONFIG.is_file():
        return None
    from ppo_core.parallel.process_group import is_main_process

    if is_main_process():  # once, not once per torchrun rank
        console.print(
            f"config: {DEFAULT_CONFIG} (--config FILE for another, --config {NO_CONFIG} for the "
            "defaults)",
            soft_wrap=True,
            highlight=False,
        )
    return DEFAULT_CONFIG


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as users read it: what happened, not the project's source line that warned."""
    return f"warning: {message}\n"


def load_settings(config_file: Path | None, overrides: list[str] | None):
    """The run's config: the file (see ``_config_file``) with the overrides; a config error is
    one line and exit code 2."""
    from ppo_core.config import load_config

    warnings.formatwarning = _warning_line

    if not sys.stderr.isatty():
        # transformers draws a bar per model load and save ("Loading weights"); in a log (DVC,
        # Prefect, CI) those are noise. Read before transformers is first imported.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    return run_or_exit(lambda: load_config(_config_file(config_file), overrides or []))


WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


# The errors users can fix, by the module that defines each. Several of those modules import
# torch and transformers (seconds), which `prepare`, `validate`, `promote`, `config` and
# `ingest` never need: an error can only be raised once its module is loaded, so each class is
# looked up among the loaded modules when an error arrives.
USER_ERRORS = (
    ("ppo_core.config", "ConfigError"),
    ("ppo_core.files", "RunLockedError"),
    ("ppo_core.registry.lineage", "LineageError"),
    ("ppo_core.checkpoints.store", "CheckpointError"),
    ("ppo_core.prompts", "PromptFileError"),
    ("ppo_core.models.gguf_export", "GGUFExportError"),
    ("ppo_core.models.policy", "ModelFolderError"),
    ("ppo_core.rewards.loading", "RewardError"),
    ("ppo_core.registry.versions", "RegistryError"),
    ("ppo_core.registry.rewards", "RewardRegistryError"),
    ("ppo_core.base_sources.kinds", "BaseSourceError"),
    ("ppo_core.registry.promotion", "StaleEvaluationError"),
    ("ppo_core.experience.engines", "EngineError"),
    ("ppo_core.rewards.gym", "GymTaskError"),
)


def _user_error(exc: BaseException) -> bool:
    if isinstance(exc, FileExistsError | FileNotFoundError):
        return True
    loaded = (sys.modules.get(module) for module, _ in USER_ERRORS)
    classes = tuple(
        getattr(module, name)
        for module, (_, name) in zip(loaded, USER_ERRORS, strict=True)
        if module is not None
    )
    return isinstance(exc, classes)


def run_or_exit(action):
    """Run a stage; turn the errors users can fix into one clear line and exit code 2."""
    try:
        return action()
    except Exception as exc:
        if _user_error(exc):
            console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
            raise typer.Exit(code=2) from None
        if not isinstance(exc, OSError) or exc.errno not in WRITE_ERRNOS:
            raise
        # disk full, read-only or forbidden folder: outputs are written atomically, so nothing
        # half-written is left behind and the previous versions stay in place
        where = f": {exc.filename}" if exc.filename else ""
        console.print(
            f"[bold red]error:[/] {exc.strerror or exc}{where}; nothing was replaced",
            soft_wrap=True,
        )
        raise typer.Exit(code=2) from None
