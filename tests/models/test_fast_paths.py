"""The update's shortcuts change no number beyond float round-off: fused GELU, logits for the
response positions only, entropy without a graph, and micro-batches trimmed of padding columns."""

import copy

import torch

from ppo_core.models.causal_lm import fuse_activations, load_tokenizer
from ppo_core.models.generation import encode_prompts
from ppo_core.models.policy import load_actor_critic
from ppo_core.models.scoring import score_sequences
from ppo_core.training.batch import RolloutBatch


def _batch(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = ["The movie was", "Honestly, I thought the acting was", "This film"]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
    generator = torch.Generator().manual_seed(0)
    response_ids = torch.randint(4, 200, (3, 7), generator=generator)
    # ragged responses: 7, 3 and 5 tokens, so the last two columns are padding in every row
    response_mask = torch.arange(7).expand(3, 7) < torch.tensor([[5], [3], [4]])
    return prompt_ids, prompt_mask, response_ids, response_mask


def test_fused_gelu_matches_the_python_one(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from transformers.activations import GELUTanh, NewGELUActivation

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    fused = fuse_activations(copy.deepcopy(plain))
    kinds = {type(m) for m in fused.modules()}
    assert GELUTanh in kinds and NewGELUActivation not in kinds
    ids = torch.randint(4, 200, (2, 9))
    with torch.no_grad():
        diff = (plain(input_ids=ids).logits - fused(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4  # False for NaN too
    assert fused.config.activation_function == plain.config.activation_function


def test_response_only_logits_equal_full_logits(tiny_model_dir):
    model = load_actor_critic(tiny_model_dir)
    prompt_ids, prompt_mask, response_ids, response_mask = _batch(tiny_model_dir)
    positions = []  # how many positions the LM head computes logits for, per call
    hook = model.policy.lm_head.register_forward_hook(
        lambda module, args, output: positions.append(output.shape[1])
    )
    with torch.no_grad():
        fast = score_sequences(
            model, prompt_ids, prompt_mask, response_ids, response_mask, with_entropy=True
        )
        input_ids = torch.cat([prompt_ids, response_ids], 1)
        attention = torch.cat([prompt_mask, response_mask], 1).long()
        logits, values = model(input_ids, attention)  # every position
        p = prompt_ids.shape[1]
        full = torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, response_ids[..., None])[
            ..., 0
        ]
    hook.remove()
    # the shortcut was taken: logits for the last T + 1 positions only, then for all P + T
    assert positions == [response_ids.shape[1] + 1, input_ids.shape[1]]
    assert torch.allclose(
        torch.where(response_mask, fast.logprobs, 0), torch.where(response_mask, full, 0), atol=1e-6
    )
    assert torch.allclose(fast.values, values[:, p - 1 : -1], atol=1e-6)


def test_entropy_carries_a_graph_only_for_an_entropy_bonus(tiny_model_dir):
    """Outside ``no_grad`` (as in the update): the logprobs have a graph; the entropy metric has
    none unless the loss uses it."""
    model = load_actor_critic(tiny_model_dir)
    batch = _batch(tiny_model_dir)
    metric = score_sequences(model, *batch, with_entropy=True)
    bonus = score_sequences(model, *batch, with_entropy=True, entropy_grad=True)
    assert metric.logprobs.requires_grad and bonus.logprobs.requires_grad
    assert not metric.entropy.requires_grad
    assert bonus.entropy.requires_grad
    torch.testing.assert_close(metric.entropy, bonus.entropy.detach(), rtol=0, atol=0)


def _loss_and_grads(model, batch: RolloutBatch):
    model.zero_grad()
    out = score_sequences(
        model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
    )
    mask = batch.response_mask
    loss = (torch.where(mask, out.logprobs * batch.advantages + out.values, 0)).sum()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_trimmed_micro_batch_gives_the_same_loss_and_gradient(tiny_model_dir):
    model = load_actor_critic(tiny_model_dir).double()  # float64: equal to round-off of 1e-16
    prompt_ids, prompt_mask, response_ids, response_mask = _batch(tiny_model_dir)
    rows = torch.tensor([0, 2])  # the two shorter prompts: their common left padding is dropped
    zeros = torch.zeros(response_ids.shape, dtype=torch.float64)
    advantages = torch.randn(response_ids.shape, dtype=torch.float64)
    batch = RolloutBatch(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        zeros,
        zeros,
        zeros,
        torch.zeros(3),
        zeros,
        advantages,
        zeros,
    ).rows(rows)
    trimmed = batch.trimmed()
    assert trimmed.prompt_ids.shape[1] < batch.prompt_ids.shape[1]
    assert trimmed.response_ids.shape[1] == 5 and trimmed.advantages.shape[1] == 5
    loss, grads = _loss_and_grads(model, batch)
    trimmed_loss, trimmed_grads = _loss_and_grads(model, trimmed)
    assert abs(loss - trimmed_loss) < 1e-12
    for full, short in zip(grads, trimmed_grads, strict=True):
        assert torch.allclose(full, short, rtol=1e-10, atol=1e-14)
    # no valid response token at all: one column stays so the shapes remain usable
    empty = batch.rows(slice(0, 1))
    empty.response_mask = torch.zeros_like(empty.response_mask)
    assert empty.trimmed().response_ids.shape[1] == 1
