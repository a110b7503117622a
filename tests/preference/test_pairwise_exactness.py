"""The reward model's pairwise loss: hand-computed values, the score read at the last real
token under every padding, and the exact accumulation over micro-batches and ranks."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_core.math.pairwise import last_token_index, pairwise_loss_parts, pairwise_stats
from ppo_core.preference.training import accumulate_pair_gradients
from ppo_core.rewards.classifier import padded, sequence_logits
from tests.helpers import build_tiny_causal_lm, free_port, spawn_ranks
from tests.preference import pair_worker


def test_pairwise_loss_by_hand_with_a_masked_nan_row():
    chosen = torch.tensor([2.0, 0.0, float("nan")], requires_grad=True)
    rejected = torch.tensor([0.0, 0.0, 1.0])
    valid = torch.tensor([True, True, False])
    parts = pairwise_loss_parts(chosen, rejected, valid)
    # -log sigmoid(2) = log(1 + e^-2) = 0.126928; -log sigmoid(0) = log 2 = 0.693147
    assert parts.total.item() == pytest.approx(0.126928 + 0.693147, abs=1e-6)
    assert int(parts.count) == 2
    parts.total.backward()
    # d/dr_c of softplus(r_r - r_c) = -sigmoid(r_r - r_c): -0.119203 and -0.5; 0 where masked
    assert chosen.grad.tolist() == pytest.approx([-0.119203, -0.5, 0.0], abs=1e-6)
    stats = pairwise_stats(chosen.detach(), rejected, valid)
    assert stats["accuracy"].item() == 0.75  # one win, one tie (half)
    assert stats["margin"].item() == 1.0


def test_margin_shifts_the_difference():
    parts = pairwise_loss_parts(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([True]), 1.0)
    assert parts.total.item() == pytest.approx(math.log(2), abs=1e-7)  # sigmoid(1 - 0 - 1)


def test_last_token_index_reads_the_mask():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 4, 0]


@pytest.fixture(scope="module")
def eos_padded_llama(tmp_path_factory):
    """A tiny Llama whose pad token is its EOS, as Qwen2 ships (SmolLM2 pads with EOS here)."""
    return build_tiny_causal_lm(tmp_path_factory.mktemp("rm") / "llama", "llama", pad="eos")


def test_score_is_read_at_the_last_real_token_whatever_the_padding(eos_padded_llama):
    from transformers import AutoTokenizer

    model = pair_worker.classifier(eos_padded_llama, torch.float32)
    eos = AutoTokenizer.from_pretrained(eos_padded_llama).eos_token_id
    assert model.config.pad_token_id == 0  # set by the builder; the texts below hold EOS
    # texts that end with EOS (the pad token), one of them holding EOS in its middle too
    rows = [[5, 9, 14, eos], [7, eos, 30, 31, 32, 33, eos], [12, 13]]
    alone = torch.cat([sequence_logits(model, *padded([row], eos))[:, 0] for row in rows])
    for side in ("right", "left"):
        ids, mask = padded(rows, eos, side)
        batch = sequence_logits(model, ids, mask)[:, 0]
        torch.testing.assert_close(batch, alone, rtol=0, atol=2e-6)  # measured 4.8e-7
    # transformers' own classifier looks for the pad id, so it reads these texts elsewhere
    model.config.pad_token_id = eos
    ids, mask = padded(rows, eos, "right")
    theirs = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert (theirs - alone).abs().max() > 1e-3


def _gradient(model, micro_batches):
    model.zero_grad(set_to_none=True)
    result = accumulate_pair_gradients(model, micro_batches, 0, 0.5, torch.device("cpu"))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, result


def _relative_error(a: dict, b: dict) -> float:
    num = sum(float((a[n] - b[n]).double().norm() ** 2) for n in b)
    den = sum(float(b[n].double().norm() ** 2) for n in b)
    return math.sqrt(num / den)


@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-14), (torch.float32, 2e-6)])
def test_micro_batch_size_never_changes_the_gradient(tiny_model_dir, dtype, bound):
    model = pair_worker.classifier(tiny_model_dir, dtype)
    pairs = pair_worker.shared_pairs(model.config.vocab_size)
    whole, result = _gradient(model, [pairs])
    assert result.global_count == len(pairs)
    for size in (1, 3):
        micro = [pairs[i : i + size] for i in range(0, len(pairs), size)]
        grads, _ = _gradient(model, micro)
        # measured: 7.5e-16 / 8.1e-16 (float64) and 3.9e-7 / 4.5e-7 (float32), AVX512 / AVX2
        # (ATEN_CPU_CAPABILITY=avx2) on one Intel Xeon
        assert _relative_error(grads, whole) <= bound, size
    # the mean of micro-batch means that the contract forbids (each chunk's own mean, averaged)
    means = {n: torch.zeros_like(g) for n, g in whole.items()}
    micro = [pairs[:1], pairs[1:]]
    for chunk in micro:
        grads, _ = _gradient(model, [chunk])
        for n in means:
            means[n] += grads[n] / len(micro)
    assert _relative_error(means, whole) > 1e-2


def test_two_ranks_give_the_single_process_gradient(tmp_path, tiny_model_dir):
    out = str(tmp_path / "grads")
    address = f"tcp://127.0.0.1:{free_port()}"
    spawn_ranks(pair_worker.run, 2, 2, address, str(tiny_model_dir), out)
    ranks = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(2)]
    model = pair_worker.classifier(tiny_model_dir)
    pairs = pair_worker.shared_pairs(model.config.vocab_size)
    whole, _ = _gradient(model, [pairs])
    for rank in ranks:
        assert rank["global_count"] == len(pairs)
        assert _relative_error(rank["grads"], whole) <= 1e-14  # float64
