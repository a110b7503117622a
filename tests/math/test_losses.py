import math

import pytest
import torch

from ppo_core import (
    aggregate_loss,
    count_units,
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from tests.helpers import assert_close
from tests.math.toy import ToyPolicy, ppo_micro_loss, random_batch


def test_policy_loss_hand_computed():
    # three tokens, log-ratios ln(1.5), ln(0.5), ln(1.1); advantages +1, -2, +3; eps 0.2
    old = torch.zeros(1, 4)
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), 0.0]])
    adv = torch.tensor([[1.0, -2.0, 3.0, float("nan")]])
    mask = torch.tensor([[True, True, True, False]])
    out = policy_loss(logp, old, adv, mask, clip_eps=0.2)
    # token 0: max(-1*1.5, -1*1.2) = -1.2 (clipped)
    # token 1: max(2*0.5, 2*0.8) = 1.6 (clipped)
    # token 2: max(-3*1.1, -3*1.1) = -3.3 (inside the range)
    assert_close(out.token_losses, [[-1.2, 1.6, -3.3, 0.0]])
    assert out.clipfrac.item() == pytest.approx(2 / 3)
    assert out.ratio.item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    # approx KL: (rho - 1) - ln rho, averaged over the 3 tokens
    kl = [(r - 1) - math.log(r) for r in (1.5, 0.5, 1.1)]
    assert out.approx_kl.item() == pytest.approx(sum(kl) / 3)
    assert float(out.clipfrac.count) == 3


def test_policy_loss_dual_clip_hand_computed():
    # rho = 5 with A = -1: plain clipped loss max(5, 1.2) = 5; dual clip c = 3 bounds it at 3
    logp = torch.tensor([[math.log(5.0), math.log(5.0)]])
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(logp, torch.zeros(1, 2), adv, mask, clip_eps=0.2, dual_clip=3.0)
    # token 1 (A = +1): max(-5, -1.2) = -1.2, untouched by the dual clip
    assert_close(out.token_losses, [[3.0, -1.2]])
    assert out.dual_clipfrac.item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(logp, torch.zeros(1, 2), adv, mask, clip_eps=0.2, dual_clip=1.0)


def test_asymmetric_clip():
    logp = torch.tensor([[math.log(1.5)]])
    out = policy_loss(
        logp,
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.ones(1, 1, dtype=torch.bool),
        clip_eps=0.2,
        clip_eps_high=0.28,
    )
    assert_close(out.token_losses, [[-1.28]])  # max(-1.5, -1.28)


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, 7.0]])
    old = torch.tensor([[0.5, 0.5, float("inf")]])
    returns = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    out = value_loss(values, old, returns, mask, clip_eps_value=0.2)
    # token 0: V=1 clipped to 0.7; errors 1 and 0.49; 0.5*max = 0.5
    # token 1: V=0 clipped to 0.3; errors 1 and 0.49; 0.5*max = 0.5
    assert_close(out.token_losses, [[0.5, 0.5, 0.0]])
    assert out.clipfrac.item() == 0.0
    # V far outside the clip range on the wrong side: V=1, old 0.5, R=2 -> clip 0.7, err 1.69 > 1
    out = value_loss(
        torch.tensor([[1.0]]),
        torch.tensor([[0.5]]),
        torch.tensor([[2.0]]),
        torch.ones(1, 1, dtype=torch.bool),
        clip_eps_value=0.2,
    )
    assert_close(out.token_losses, [[0.845]])
    assert out.clipfrac.item() == 1.0
    unclipped = value_loss(values, old, returns, mask, clip_eps_value=None)
    assert_close(unclipped.token_losses, [[0.5, 0.5, 0.0]])


def test_logprobs_and_entropy_hand_computed():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    assert_close(logprobs_from_logits(logits, torch.tensor([[1]])), [[math.log(0.25)]])
    # H = -(0.5 ln 0.5 + 2 * 0.25 ln 0.25) = 1.5 ln 2
    assert_close(entropy_from_logits(logits), [[1.5 * math.log(2)]])
    # temperature 2 on logits [0, ln 2]: probs proportional to [1, sqrt(2)]
    logits = torch.tensor([[[0.0, math.log(2.0)]]])
    p1 = math.sqrt(2) / (1 + math.sqrt(2))
    assert_close(
        logprobs_from_logits(logits, torch.tensor([[1]]), temperature=2.0), [[math.log(p1)]]
    )


def test_aggregation_modes_hand_computed():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("nan")], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    # token-mean: (1 + 2 + 3 + 4) over 4 tokens
    parts = aggregate_loss(losses, mask, "token-mean")
    assert (parts.total.item(), parts.count.item()) == (10.0, 4)
    # seq-mean-token-mean: token means 2 and 4 over 2 non-empty sequences
    parts = aggregate_loss(losses, mask, "seq-mean-token-mean")
    assert (parts.total.item(), parts.count.item()) == (6.0, 2)
    # seq-mean-token-sum: token sums 6 and 4 over 2 non-empty sequences
    parts = aggregate_loss(losses, mask, "seq-mean-token-sum")
    assert (parts.total.item(), parts.count.item()) == (10.0, 2)
    assert count_units(mask, "token-mean").item() == 4
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        aggregate_loss(losses, mask, "mean")


def test_aggregation_sums_low_precision_in_float32():
    parts = aggregate_loss(torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(2, 3), "token-mean")
    assert parts.total.dtype == torch.float32


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_garbage_under_the_mask_changes_no_gradient(garbage, mode):
    clean = random_batch(seed=1, batch=6, length=5, empty_rows=(2,))
    dirty = random_batch(seed=1, batch=6, length=5, empty_rows=(2,), garbage=garbage)
    grads = []
    for data in (clean, dirty):
        model = ToyPolicy(seed=0)
        parts, stats = ppo_micro_loss(model, data, mode)
        (parts.total / parts.count).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert all(torch.isfinite(s.mean) for s in stats.values())
    for clean_grad, dirty_grad in zip(*grads, strict=True):
        assert torch.isfinite(dirty_grad).all()
        assert torch.equal(clean_grad, dirty_grad)


def test_the_kl_loss_term_hand_computed():
    """``kl_coef * k3`` per token, with its gradient ``kl_coef * (1 - exp(ref - logp))``; with no
    critic there is no value term and no value statistic."""
    from ppo_core import PPOObjective

    logp = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.4), float("nan")]])
    mask = torch.tensor([[True, True, False]])
    zeros = torch.zeros(1, 3)
    objective = PPOObjective(kl_coef=0.5, kl_estimator="k3", loss_agg_mode="token-mean")
    parts, stats = objective(
        logp, None, None, logp.detach(), None, zeros, None, mask, ref_logprobs=ref
    )
    # d = logp - ref = ln 2, ln 0.5; k3 = exp(-d) - 1 + d; the policy term is 0 (A = 0)
    k3 = [0.5 - 1 + math.log(2), 2 - 1 + math.log(0.5)]
    assert float(parts.total.detach()) == pytest.approx(0.5 * sum(k3))
    assert float(parts.count) == 2
    assert stats["kl_loss"].item() == pytest.approx(sum(k3) / 2)
    assert "value_loss" not in stats and "vf_clipfrac" not in stats
    parts.total.backward()
    assert_close(logp.grad, [[0.5 * (1 - 0.5), 0.5 * (1 - 2.0), 0.0]])
    # off (the default): the same call adds nothing
    parts, stats = PPOObjective()(logp, None, None, logp.detach(), None, zeros, None, mask)
    assert float(parts.total.detach()) == 0.0 and "kl_loss" not in stats
    with pytest.raises(ValueError, match="reference"):
        objective(logp, None, None, logp.detach(), None, zeros, None, mask)
    with pytest.raises(ValueError, match="together"):
        PPOObjective()(logp, zeros, None, logp.detach(), None, zeros, None, mask)


def test_truncated_importance_weights_hand_computed():
    """TIS (Yao et al. 2025): ``min(pi_old / pi_sampler, cap)`` per response token, 0 where
    masked, no graph; it multiplies each token's policy loss and nothing else."""
    from ppo_core import PPOObjective
    from ppo_core.math.losses import truncated_importance_weights

    # trainer probabilities 0.5, 0.2, 0.9 against the sampler's 0.25, 0.4, 0.3; cap 2
    trainer = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.7]]))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.3, 0.1]]))
    mask = torch.tensor([[True, True, True, False]])
    weights = truncated_importance_weights(trainer.requires_grad_(), sampler, mask, cap=2.0)
    # 0.5 / 0.25 = 2 (at the cap), 0.2 / 0.4 = 0.5, 0.9 / 0.3 = 3 -> 2 (truncated), masked 0
    assert_close(weights, [[2.0, 0.5, 2.0, 0.0]])
    assert not weights.requires_grad
    # in the objective: token losses of policy_loss_hand_computed's case, weighted
    old = torch.zeros(1, 4)
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1), 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 3.0, 0.0]])
    objective = PPOObjective(loss_agg_mode="token-mean")
    parts, stats = objective(
        logp, None, None, old, None, adv, None, mask, importance_weights=weights
    )
    # 2 * -1.2 + 0.5 * 1.6 + 2 * -3.3 = -8.2 over 3 tokens
    assert float(parts.total.detach()) == pytest.approx(-8.2)
    assert stats["policy_loss"].item() == pytest.approx((-1.2 + 1.6 - 3.3) / 3)  # unweighted
    unweighted, _ = objective(logp, None, None, old, None, adv, None, mask)
    assert float(unweighted.total.detach()) == pytest.approx(-1.2 + 1.6 - 3.3)
