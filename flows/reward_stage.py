"""``ppo reward``: train a reward model on the published feedback pairs, judge it on the
held-out pairs against the current reward version, and promote it as the next version when
it passes (docs/design.md section 3, "Reward versions").

It writes, always:
- ``<report_dir>/metrics.json``: held-out accuracy, margin, calibration and accuracy by length
  bias of the new model (``new/*``) and of the current version on the same pairs
  (``current/*``); a DVC metric;
- ``<report_dir>/decision.json``: the decision, its reasons and the registry entry (without
  its date, so that a rerun of one commit writes the same bytes);
- ``<report_dir>/current.json``: which reward version is current and its content hash. The
  ``train`` stage depends on this file only, so PPO runs again exactly when the reward it would
  use changed.

With no feedback pairs it trains nothing and says so; the current version stays. Nor does it
train again on a pair version it has already judged with the same settings (the registry has
an entry with its data hash and settings): it writes the reports of that decision again, so
that a ``dvc repro`` after ``ppo rollback --reward`` (which rewrites ``current.json``) retrains
PPO on the rolled-back version instead of training a new reward model over it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from flows.provenance import code_version
from ppo_core.config import Config
from ppo_core.files import atomic_write_text
from ppo_core.files.artifacts import EVAL_METRICS
from ppo_core.preference.pairs import FEEDBACK_FOLDER, read_pair_split, read_pair_version
from ppo_core.registry.rewards import (
    current_reward,
    load_reward_registry,
    record_reward_decision,
)

__all__ = ["reward", "write_current"]


def reward(config: Config, progress=print, on_step=None) -> dict[str, Any]:
    """The stage (module docstring); returns the decision as ``decision.json`` holds it.
    ``progress`` gets its lines, ``on_step(done, total)`` the training's optimizer steps."""
    rm = config.reward_model
    report_dir = Path(rm.report_dir)
    folder = Path(config.data.prepared_dir) / FEEDBACK_FOLDER
    manifest = read_pair_version(folder)
    incumbent = current_reward(rm.versions_dir)
    if not manifest.get("pairs"):
        reason = f"{folder} holds no preference pairs; nothing to train"
        decision = {
            "decision": "no feedback",
            "reasons": [reason],
            "current": incumbent.name if incumbent else None,
        }
        _write_reports(report_dir, {}, decision, rm.versions_dir)
        progress(reason)
        return decision
    from ppo_core.preference.training import training_settings

    data_hash = manifest["content_hash"]
    settings = training_settings(config)
    judged = _judged(rm.versions_dir, data_hash, settings)
    if judged is not None:
        reason = (
            f"the pair version {data_hash[:12]} was judged with these settings on "
            f"{judged.get('date')} ({judged.get('decision')}"
            + (f" as {judged['version']}" if judged.get("version") else "")
            + "); nothing to train"
        )
        decision = {
            "decision": "already judged",
            "reasons": [reason],
            "current": incumbent.name if incumbent else None,
        }
        _write_reports(report_dir, {}, decision, rm.versions_dir)
        progress(reason)
        return decision
    chat = bool(manifest.get("chat"))
    train_pairs = read_pair_split(folder, "train", chat)
    eval_pairs = read_pair_split(folder, "eval", chat)
    new_metrics, incumbent_metrics, result = _train_and_judge(
        config, train_pairs, eval_pairs, data_hash, incumbent, progress, on_step
    )
    new_metrics = _finite(new_metrics)
    incumbent_metrics = _finite(incumbent_metrics) if incumbent_metrics is not None else None
    from ppo_core.preference.gate import reward_gate

    verdict = reward_gate(new_metrics, incumbent_metrics, rm.gate)
    entry = record_reward_decision(
        rm.versions_dir,
        rm.output_dir,
        verdict.promote,
        {
            "reasons": verdict.reasons,
            "data_hash": data_hash,
            "base": str(rm.base or config.model.policy),
            "parent": incumbent.name if incumbent else None,
            "metrics": new_metrics,
            "parent_metrics": incumbent_metrics,
            "score_mean": result.score_mean,
            "score_std": result.score_std,
            "settings": settings,
            "train_pairs": len(train_pairs),
            "eval_pairs": len(eval_pairs),
            "code_version": code_version(),
        },
    )
    decision = {k: v for k, v in entry.items() if k not in ("date", "code_version")}
    flat = {f"new/{k}": v for k, v in new_metrics.items()}
    flat.update({f"current/{k}": v for k, v in (incumbent_metrics or {}).items()})
    _write_reports(report_dir, flat, decision, rm.versions_dir)
    for reason in verdict.reasons:
        progress(reason)
    progress(
        f"reward model {entry['decision']}"
        + (f" as {entry['version']}" if entry.get("version") else "")
    )
    return decision


def _judged(versions_dir: str, data_hash: str, settings: dict) -> dict | None:
    """The newest registry entry that judged ``data_hash`` with ``settings``, if any."""
    entries = load_reward_registry(versions_dir)["entries"]
    return next(
        (
            e
            for e in reversed(entries)
            if e.get("data_hash") == data_hash
            and e.get("settings") == settings
            and e.get("decision") in ("promoted", "rejected")
        ),
        None,
    )


def _train_and_judge(
    config: Config, train_pairs, eval_pairs, data_hash, incumbent, progress, on_step
):
    """Train the new model, then score the held-out pairs with it and with the incumbent (in
    the training's precision)."""
    from ppo_core.models.causal_lm import load_tokenizer
    from ppo_core.parallel.runtime import Runtime, choose_precision, model_width, resolve_device
    from ppo_core.preference.pairs import tokenise
    from ppo_core.preference.report import pair_report
    from ppo_core.preference.training import score_texts, train_reward_model
    from ppo_core.rewards.classifier import load_reward_classifier

    device = resolve_device(config.device)
    result = train_reward_model(
        config, train_pairs, data_hash, device, progress=progress, on_step=on_step
    )
    batch = 2 * config.reward_model.micro_batch_size
    width = model_width(config.reward_model.base or config.model.policy)
    precision = choose_precision(config.precision, device, width).precision
    autocast = Runtime(device=device, precision=precision).autocast

    def judge(folder: Path, role: str) -> dict[str, float]:
        tokenizer = load_tokenizer(folder, config.model.trust_remote_code)
        model = load_reward_classifier(folder, role, config.model.trust_remote_code).to(device)
        positions = getattr(model.config, "max_position_embeddings", None) or 1_000_000
        pairs = tokenise(tokenizer, eval_pairs, positions)
        pad = tokenizer.pad_token_id
        chosen = score_texts(model, [p.chosen_ids for p in pairs], pad, device, batch, autocast)
        rejected = score_texts(model, [p.rejected_ids for p in pairs], pad, device, batch, autocast)
        # lengths of the replies alone: the bias people's labels may carry
        lengths = [
            [len(tokenizer(getattr(p, side), add_special_tokens=False)["input_ids"])]
            for p in eval_pairs
            for side in ("chosen", "rejected")
        ]
        chosen_lengths = [row[0] for row in lengths[0::2]]
        rejected_lengths = [row[0] for row in lengths[1::2]]
        return pair_report(chosen, rejected, chosen_lengths, rejected_lengths)

    new_metrics = judge(result.output_dir, "the new reward model")
    incumbent_metrics = (
        judge(incumbent.folder, f"reward version {incumbent.name}") if incumbent else None
    )
    return new_metrics, incumbent_metrics, result


def _finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with NaN (a length group without pairs) as null: JSON has no NaN."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()
    }


def _write_reports(
    report_dir: Path, metrics: dict[str, Any], decision: dict[str, Any], versions_dir: str
) -> None:
    report_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(report_dir / EVAL_METRICS, json.dumps(metrics, indent=1) + "\n")
    atomic_write_text(report_dir / "decision.json", json.dumps(decision, indent=1) + "\n")
    write_current(report_dir, versions_dir)


def write_current(report_dir: Path, versions_dir: str) -> None:
    """``current.json``: the current reward version and its content hash (null before one)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    current = current_reward(versions_dir)
    state = {
        "current": current.name if current else None,
        "content_sha256": current.entry.get("content_sha256") if current else None,
    }
    atomic_write_text(report_dir / "current.json", json.dumps(state, indent=1) + "\n")
