"""A tiny policy-and-value model and a random PPO mini-batch, for the accumulation tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ppo_core import (
    LossParts,
    PPOObjective,
    RunningMean,
    entropy_from_logits,
    logprobs_from_logits,
)
from ppo_core.math.declarations import LossAggMode

VOCAB = 11
HIDDEN = 8


class ToyPolicy(nn.Module):
    """Embedding -> tanh MLP -> (logits [B, T, V], values [B, T])."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float64):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen, dtype=dtype))
        self.hidden = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen, dtype=dtype) * 0.5)
        self.lm_head = nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=gen, dtype=dtype) * 0.5)
        self.value_head = nn.Parameter(torch.randn(HIDDEN, 1, generator=gen, dtype=dtype) * 0.5)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(self.embed[tokens] @ self.hidden)
        return h @ self.lm_head, (h @ self.value_head).squeeze(-1)


@dataclass
class ToyBatch:
    tokens: Tensor  # [B, T] inputs
    actions: Tensor  # [B, T] taken tokens
    response_mask: Tensor  # [B, T]
    old_logprobs: Tensor
    old_values: Tensor
    advantages: Tensor
    returns: Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: slice | Tensor) -> ToyBatch:
        return ToyBatch(**{k: v[index] for k, v in vars(self).items()})


def random_batch(
    seed: int,
    batch: int,
    length: int,
    dtype: torch.dtype = torch.float64,
    p_valid: float = 0.6,
    empty_rows: tuple[int, ...] = (),
    garbage: float | None = None,
) -> ToyBatch:
    """Random data with a random mask; ``empty_rows`` are fully masked; ``garbage`` fills masked
    positions of the float fields (NaN, inf, ...)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) < p_valid
    for row in empty_rows:
        mask[row] = False

    def floats(scale: float = 1.0) -> Tensor:
        values = torch.randn(batch, length, generator=gen, dtype=dtype) * scale
        return values if garbage is None else torch.where(mask, values, garbage)

    return ToyBatch(
        tokens=torch.randint(0, VOCAB, (batch, length), generator=gen),
        actions=torch.randint(0, VOCAB, (batch, length), generator=gen),
        response_mask=mask,
        old_logprobs=floats(0.3) - 2.4,
        old_values=floats(),
        advantages=floats(),
        returns=floats(),
    )


def ppo_micro_loss(
    model: nn.Module,
    mb: ToyBatch,
    mode: LossAggMode,
    objective: PPOObjective | None = None,
) -> tuple[LossParts, dict[str, RunningMean]]:
    """The trainer's PPO objective on one toy micro-batch: (sum, count) plus its statistics.

    The default coefficients switch every term on (value loss, entropy bonus, both clips)."""
    objective = objective or PPOObjective(
        clip_eps=0.2, clip_eps_value=0.2, vf_coef=0.5, entropy_coef=0.01, loss_agg_mode=mode
    )
    logits, values = model(mb.tokens)
    logprobs = logprobs_from_logits(logits, mb.actions)
    return objective(
        logprobs,
        values,
        entropy_from_logits(logits),
        mb.old_logprobs,
        mb.old_values,
        mb.advantages,
        mb.returns,
        mb.response_mask,
    )


def relative_error(actual: list[Tensor], expected: list[Tensor]) -> float:
    """The largest absolute difference of two lists of gradients over the largest expected
    magnitude."""
    diff = max((a - e).abs().max().item() for a, e in zip(actual, expected, strict=True))
    scale = max(e.abs().max().item() for e in expected)
    return diff / scale
