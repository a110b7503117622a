"""Training a reward model on preference pairs with the Bradley-Terry loss (layer 3).

The update keeps the project's exactness contract (docs/design.md section 4) with the pair as
the unit: a mini-batch of ``reward_model.batch_size`` pairs a rank is split into micro-batches
of ``reward_model.micro_batch_size`` pairs; the pairs of all ranks are counted first
(``N``), each micro-batch backpropagates ``S * R / N`` (``S`` its loss sum), and the ranks'
gradients are averaged, so the step is the one of the whole mini-batch in one pass, whatever
the micro-batch size and the number of ranks (:func:`accumulate_pair_gradients`;
``tests/preference/test_pairwise_exactness.py``).

A micro-batch's chosen and rejected texts run as one forward pass (``2b`` rows, right-padded),
and each score is read at its text's last real token (:mod:`ppo_core.rewards.classifier`).
Checkpoints are written every ``reward_model.checkpoint_every`` epochs, atomically; a killed
run resumes from the newest one that verifies when the data and settings are the same, and
sets the others aside otherwise.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ppo_core.checkpoints.store import load_latest_good, save_checkpoint, save_tensors
from ppo_core.config import Config
from ppo_core.config.stage_sections import RewardModelConfig
from ppo_core.feedback.rows import PreferencePair
from ppo_core.files import atomic_folder, exclusive_run, folder_fingerprint
from ppo_core.math.accumulation import (
    AccumulationResult,
    accumulate_gradients,
    data_parallel_world_size,
)
from ppo_core.math.pairwise import pairwise_loss_parts, pairwise_stats
from ppo_core.math.running_mean import RunningMean
from ppo_core.models.causal_lm import load_tokenizer, unwrap_model
from ppo_core.parallel.runtime import setup_runtime
from ppo_core.preference.pairs import TokenisedPair, tokenise
from ppo_core.rewards.classifier import HEAD_NAME, new_reward_classifier, padded, sequence_logits

__all__ = [
    "RECORD_FILE",
    "RewardTrainingResult",
    "accumulate_pair_gradients",
    "pair_scores",
    "score_texts",
    "train_reward_model",
    "training_settings",
]

RECORD_FILE = "reward_model.json"
"""What a trained reward model folder records of itself: data hash, base, settings, history
and the normalisation of its scores (``score_mean``, ``score_std``)."""
TRAINABLE_FILE = "trainable.pt"
"""A checkpoint's trained weights (every weight, or LoRA's and the head's)."""
COMPUTATION_KEYS = (
    "lora",
    "lora_rank",
    "lora_alpha",
    "epochs",
    "batch_size",
    "lr",
    "weight_decay",
    "margin",
    "max_grad_norm",
    "seed",
)
"""The settings a checkpoint must share with a run to continue it (``micro_batch_size`` does
not change the result, so a run may resume with another)."""


@dataclass
class RewardTrainingResult:
    """A finished reward-model run: where the model is and what it learnt."""

    output_dir: Path
    history: list[dict[str, float]]
    score_mean: float
    score_std: float
    resumed_from: str | None = None
    record: dict[str, Any] = field(default_factory=dict)


Autocast = Callable[[], contextlib.AbstractContextManager]
"""The context forward passes run in: :meth:`~ppo_core.parallel.runtime.Runtime.autocast`
(bf16 autocast with ``precision=bf16``), or nothing."""


def pair_scores(
    model: nn.Module,
    micro_batch: Sequence[TokenisedPair],
    pad_id: int,
    device: torch.device,
    autocast: Autocast = contextlib.nullcontext,
) -> tuple[Tensor, Tensor]:
    """Scores ``[b]`` (float32) of the chosen and the rejected texts of ``micro_batch``, one
    forward pass of ``2b`` right-padded rows."""
    rows = [pair.chosen_ids for pair in micro_batch] + [pair.rejected_ids for pair in micro_batch]
    input_ids, attention_mask = padded(rows, pad_id)
    with autocast():
        scores = sequence_logits(model, input_ids.to(device), attention_mask.to(device))[:, 0]
    return scores[: len(micro_batch)], scores[len(micro_batch) :]


def accumulate_pair_gradients(
    model: nn.Module,
    micro_batches: Sequence[Sequence[TokenisedPair]],
    pad_id: int,
    margin: float,
    device: torch.device,
    group: Any = None,
    autocast: Autocast = contextlib.nullcontext,
) -> AccumulationResult:
    """Backpropagate one mini-batch's Bradley-Terry loss (sum over its pairs on all ranks
    divided by their number) through ``micro_batches``, this rank's share; gradients end in
    ``.grad``, averaged over the ranks. The optimizer step is the caller's."""

    def loss_fn(micro_batch: Sequence[TokenisedPair]):
        chosen, rejected = pair_scores(model, micro_batch, pad_id, device, autocast)
        valid = torch.ones(len(micro_batch), dtype=torch.bool, device=chosen.device)
        parts = pairwise_loss_parts(chosen, rejected, valid, margin)
        return parts, pairwise_stats(chosen.detach(), rejected.detach(), valid)

    result = accumulate_gradients(micro_batches, loss_fn, len, group=group)
    if data_parallel_world_size(group) > 1:
        _average_gradients(model, group)
    return result


def _average_gradients(model: nn.Module, group: Any) -> None:
    """What DDP does after the backward passes: each gradient averaged over the ranks (a rank
    without pairs contributes zeros)."""
    world_size = data_parallel_world_size(group)
    for parameter in model.parameters():
        if not parameter.requires_grad:
            continue
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM, group=group)
        parameter.grad /= world_size


@torch.no_grad()
def score_texts(
    model: nn.Module,
    rows: Sequence[list[int]],
    pad_id: int,
    device: torch.device,
    batch: int,
    autocast: Autocast = contextlib.nullcontext,
) -> Tensor:
    """Scores ``[len(rows)]`` (float64) of token-id rows, ``batch`` rows a forward pass."""
    scores = []
    for i in range(0, len(rows), batch):
        input_ids, attention_mask = padded(rows[i : i + batch], pad_id)
        with autocast():
            scores.append(
                sequence_logits(model, input_ids.to(device), attention_mask.to(device))[:, 0]
            )
    return torch.cat(scores).double().cpu() if scores else torch.zeros(0, dtype=torch.float64)


def _with_lora(model: nn.Module, rank: int, alpha: float) -> nn.Module:
    """``model`` with LoRA adapters on every linear layer of its trunk and its head trained
    whole (``peft``'s ``modules_to_save``)."""
    from peft import LoraConfig, get_peft_model

    from ppo_core.models.lora import quiet_peft

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates int; the scale is alpha / r
        target_modules="all-linear",
        exclude_modules=[HEAD_NAME],
        modules_to_save=[HEAD_NAME],
        task_type="SEQ_CLS",
        bias="none",
    )
    with quiet_peft():
        return get_peft_model(model, config)


def _trainable_state(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def training_settings(config: Config) -> dict[str, Any]:
    """What a reward-model run's result depends on besides its data: the settings of
    :data:`COMPUTATION_KEYS` and the fingerprint of the base it starts from."""
    rm = config.reward_model
    settings = {key: getattr(rm, key) for key in COMPUTATION_KEYS}
    return {
        **settings,
        "precision": config.precision,
        "base_fingerprint": folder_fingerprint(rm.base or config.model.policy),
    }


def _mini_batches(count: int, size: int, seed: int, epoch: int) -> list[list[int]]:
    """The epoch's shuffle of ``count`` pairs cut into mini-batches of ``size`` (the last one
    may be smaller: its loss is divided by its own pair count)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(count, generator=generator).tolist()
    return [order[i : i + size] for i in range(0, count, size)]


def _resume(
    checkpoint_dir: Path, settings: dict[str, Any], data_hash: str, model: nn.Module, optimizer
) -> tuple[int, list[dict[str, float]], str | None, list[str]]:
    """The epoch to start from, the history so far, the checkpoint resumed and notes; a
    checkpoint of other data or settings is set aside (renamed, never deleted)."""
    from ppo_core.checkpoints.store import list_checkpoints, load_tensors

    folder, loaded, problems = load_latest_good(checkpoint_dir)
    if folder is None or loaded is None:
        return 0, [], None, problems
    state = loaded["state"]
    if state.get("data_hash") != data_hash or state.get("settings") != settings:
        aside = checkpoint_dir / f"stale-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir(parents=True, exist_ok=True)
        for old in list_checkpoints(checkpoint_dir):
            old.rename(aside / old.name)
        return 0, [], None, [*problems, f"checkpoints of other data or settings moved to {aside}"]
    trained = load_tensors(loaded["model_dir"] / TRAINABLE_FILE)
    missing = [
        name for name, p in model.named_parameters() if p.requires_grad and name not in trained
    ]
    if missing:
        raise RuntimeError(f"checkpoint {folder} lacks trained weights {missing[:3]}")
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in trained.items():
            named[name].copy_(tensor)
    optimizer.load_state_dict(loaded["optimizer"])
    return int(state["iteration"]), list(state.get("history", [])), folder.name, problems


@dataclass
class _Run:
    """What every step of one reward-model run uses."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    tokenised: list[TokenisedPair]
    pad_id: int
    device: torch.device
    autocast: Autocast
    rank: int
    world_size: int


def train_reward_model(
    config: Config,
    train_pairs: list[PreferencePair],
    data_hash: str,
    device: torch.device | None = None,
    progress: Callable[[str], None] | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> RewardTrainingResult:
    """Train a reward model on ``train_pairs`` (see the module docstring) and write it to
    ``reward_model.output_dir`` atomically, with :data:`RECORD_FILE` beside the weights.

    ``progress`` gets a line per epoch and note; ``on_step(done, total)`` is called after each
    optimizer step with the run's steps done and its total (a progress bar's feed). Forward
    passes run under bf16 autocast where ``precision`` resolves to bf16 (``choose_precision``)."""
    rm = config.reward_model
    base = rm.base or config.model.policy
    runtime = setup_runtime(config, distributed=False, model_folder=base)
    device = device or runtime.device  # CUDA when there is one
    say = progress or (lambda _line: None)
    tokenizer = load_tokenizer(base, config.model.trust_remote_code)
    model: nn.Module = new_reward_classifier(
        base, tokenizer.pad_token_id, config.model.trust_remote_code, rm.seed
    )
    if rm.lora:
        model = _with_lora(model, rm.lora_rank, rm.lora_alpha)
    model = model.to(device).eval()  # eval: no dropout, the two texts of a pair see one network
    trainable = [p for p in model.parameters() if p.requires_grad]
    positions = getattr(unwrap_model(model).config, "max_position_embeddings", None)
    run = _Run(
        model=model,
        optimizer=torch.optim.AdamW(trainable, lr=rm.lr, weight_decay=rm.weight_decay),
        tokenised=tokenise(tokenizer, train_pairs, positions or 1_000_000),
        pad_id=tokenizer.pad_token_id,
        device=device,
        autocast=runtime.autocast,
        rank=dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
        world_size=data_parallel_world_size(),
    )
    settings = training_settings(config)
    checkpoint_dir = Path(rm.checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_run(checkpoint_dir / ".run.lock", f"reward-model training in {checkpoint_dir}"):
        start, history, resumed, notes = _resume(
            checkpoint_dir, settings, data_hash, model, run.optimizer
        )
        for note in notes:
            say(note)
        if resumed:
            say(f"resuming from {checkpoint_dir / resumed} (epoch {start} of {rm.epochs})")
        for epoch in range(start, rm.epochs):
            row = _train_epoch(run, rm, epoch, on_step)
            history.append(row)
            if run.rank == 0 and ((epoch + 1) % rm.checkpoint_every == 0 or epoch + 1 == rm.epochs):
                save_checkpoint(
                    checkpoint_dir,
                    epoch + 1,
                    lambda folder: _save_trainable(model, folder),
                    run.optimizer.state_dict(),
                    None,
                    {"data_hash": data_hash, "settings": settings, "history": history},
                )
            say(
                f"reward model epoch {epoch + 1}/{rm.epochs}: loss {row['reward_train/loss']:.4f}"
                f"  accuracy {row.get('reward_train/accuracy', math.nan):.3f}"
            )
        mean, std = _normalisation(run, 2 * rm.micro_batch_size)
        record = {
            "data_hash": data_hash,
            "base": str(base),
            "settings": settings,
            "train_pairs": len(train_pairs),
            "history": history,
            "score_mean": mean,
            "score_std": std,
            "normalisation_set": "the train pairs' chosen and rejected replies",
        }
        output = _write_output(model, tokenizer, Path(rm.output_dir), record, run.rank)
    return RewardTrainingResult(output, history, mean, std, resumed, record)


def _train_epoch(
    run: _Run, rm: RewardModelConfig, epoch: int, on_step: Callable[[int, int], None] | None
) -> dict[str, float]:
    """One epoch's optimizer steps, one a mini-batch of ``rm.batch_size`` pairs a rank (the
    exact accumulation of :func:`accumulate_pair_gradients`); returns the epoch's history row."""
    loss, stats = RunningMean.zero(), dict[str, RunningMean]()
    global_batch = rm.batch_size * run.world_size
    steps_per_epoch = math.ceil(len(run.tokenised) / global_batch)
    trainable = [p for p in run.model.parameters() if p.requires_grad]
    batches = _mini_batches(len(run.tokenised), global_batch, rm.seed, epoch)
    for step, rows in enumerate(batches, start=1):
        mine = [
            run.tokenised[i]
            for i in rows[run.rank * rm.batch_size : (run.rank + 1) * rm.batch_size]
        ]
        micro = [
            mine[i : i + rm.micro_batch_size] for i in range(0, len(mine), rm.micro_batch_size)
        ]
        result = accumulate_pair_gradients(
            run.model, micro, run.pad_id, rm.margin, run.device, autocast=run.autocast
        )
        if rm.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(trainable, rm.max_grad_norm)
            if not torch.isfinite(norm):
                raise FloatingPointError(
                    f"reward model: non-finite gradient norm in epoch {epoch + 1}; no step was "
                    "taken (lower reward_model.lr)"
                )
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        loss = loss.merge(result.loss)
        for name, value in result.stats.items():
            stats[name] = stats[name].merge(value) if name in stats else value
        if on_step is not None:
            on_step(epoch * steps_per_epoch + step, rm.epochs * steps_per_epoch)
    return {
        "epoch": epoch + 1,
        "reward_train/loss": loss.item(),
        **{f"reward_train/{name}": value.item() for name, value in stats.items()},
    }


def _normalisation(run: _Run, batch: int) -> tuple[float, float]:
    """Mean and standard deviation of the trained model's scores of the train pairs' chosen
    and rejected replies (the scale ``reward:...`` specs standardise by)."""
    replies = [p.chosen_ids for p in run.tokenised] + [p.rejected_ids for p in run.tokenised]
    scores = score_texts(run.model, replies, run.pad_id, run.device, batch, run.autocast)
    mean = float(scores.mean()) if len(scores) else 0.0
    std = float(scores.std()) if len(scores) > 1 else 1.0
    return mean, std if std > 1e-6 else 1.0  # a constant model: leave its scale alone


def _save_trainable(model: nn.Module, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_tensors(_trainable_state(model), folder / TRAINABLE_FILE)


def _write_output(
    model: nn.Module, tokenizer: Any, output_dir: Path, record: dict[str, Any], rank: int
) -> Path:
    """The trained reward model as a plain ``save_pretrained`` sequence-classification folder
    (LoRA merged in), its tokenizer and :data:`RECORD_FILE`; rank 0 writes it."""
    if rank != 0:
        return output_dir
    inner: Any = model
    if type(model).__module__.startswith("peft."):
        inner = model.merge_and_unload()  # type: ignore[operator]

    def write(tmp: Path) -> None:
        inner.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1))

    return atomic_folder(output_dir, write)
