"""A tiny policy-and-value model and a random PPO mini-batch, for the accumulation tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ppo_core import (
    LossParts,
    RunningMean,
    aggregate_loss,
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)

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
    mode: str,
    clip_eps: float = 0.2,
    clip_eps_value: float | None = 0.2,
    vf_coef: float = 0.5,
    entropy_coef: float = 0.01,
) -> tuple[LossParts, dict[str, RunningMean]]:
    """The full PPO objective of one micro-batch as (sum, count) plus its statistics."""
    logits, values = model(mb.tokens)
    logprobs = logprobs_from_logits(logits, mb.actions)
    pg = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.response_mask, clip_eps)
    vf = value_loss(values, mb.old_values, mb.returns, mb.response_mask, clip_eps_value)
    entropy = entropy_from_logits(logits)
    token_losses = pg.token_losses + vf_coef * vf.token_losses - entropy_coef * entropy
    parts = aggregate_loss(token_losses, mb.response_mask, mode)
    return parts, {"clipfrac": pg.clipfrac, "approx_kl": pg.approx_kl, "vf_clipfrac": vf.clipfrac}
