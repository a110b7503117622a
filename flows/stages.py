"""The pipeline's stages as plain functions of the config (one implementation each).

``dvc.yaml`` runs them as ``ppo <stage>``; the Prefect flow calls the same commands. Each reads
and writes files only, and writes its outputs atomically.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ppo_core.config import Config


def base(config: Config) -> Path:
    """Import ``base.source`` into ``model.policy``, or build the tiny default there."""
    target = Path(config.model.policy)
    if config.base.source is None:
        from ppo_core.modeling.tiny_default import build_tiny_default

        return build_tiny_default(target, seed=config.base.tiny_seed, steps=config.base.tiny_steps,
                                  num_threads=config.threads or None)
    from ppo_core.modeling.checkpoint import atomic_folder
    from ppo_core.modeling.policy import load_causal_lm, load_tokenizer

    source = Path(config.base.source)
    # Load both first: a folder that cannot serve as a policy is refused before anything is written.
    load_tokenizer(source, config.model.trust_remote_code)
    load_causal_lm(source, "base.source", config.model.trust_remote_code)

    def write(tmp: Path) -> None:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        (tmp / "imported_from.json").write_text(json.dumps(
            {"source": str(source.resolve()), "imported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))

    return atomic_folder(target, write)


def train(config: Config, show_progress: bool = True):
    """The PPO loop with DVCLive metrics and a progress bar."""
    from flows.loggers import ConsoleProgress, DVCLiveLogger
    from ppo_core.trainer import train as run_training

    loggers = [DVCLiveLogger(config.train.metrics_dir)]
    if show_progress:
        loggers.append(ConsoleProgress(config.train.iterations))
    try:
        return run_training(config, loggers=loggers)
    finally:
        for logger in loggers:
            logger.close()


def evaluate(config: Config, candidate: str | None = None, baseline: str | None = None):
    """Evaluate the candidate (default ``train.output_dir``) against a baseline (default
    ``model.policy``)."""
    from ppo_core.evaluation import evaluate as run_evaluation

    return run_evaluation(config, candidate or config.train.output_dir,
                          baseline if baseline is not None else config.model.policy)
