import torch

from ppo_core.modeling.generation import (
    decode_responses,
    encode_prompts,
    generate_responses,
    response_mask_from_ids,
)
from ppo_core.modeling.policy import load_actor_critic, load_tokenizer, score_sequences


def test_response_mask_keeps_the_first_eos_and_works_when_pad_is_eos():
    eos = 2
    ids = torch.tensor([[5, 6, 2, 2, 2], [5, 2, 7, 2, 9], [5, 6, 7, 8, 9]])
    mask, has_eos = response_mask_from_ids(ids, eos)
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, True, False, False, False],
        [True, True, True, True, True],
    ]
    assert has_eos.tolist() == [True, True, False]


def test_sampled_and_recomputed_logprobs_agree(tiny_model_dir):
    """Left padding, positions from the attention mask, same temperature: the forward pass
    reproduces the distribution that generation sampled from (DESIGN.md section 8)."""
    model = load_actor_critic(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = ["The movie was", "Honestly, I thought the acting", "This film"]
    torch.manual_seed(0)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
    assert (prompt_mask[:, 0] == 0).any(), "prompts of different lengths should be left-padded"
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=True,
        temperature=0.7,
        top_k=None,
        top_p=1.0,
        max_new_tokens=8,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = model.policy.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config
    )
    response = out.sequences[:, prompt_ids.shape[1] :]
    mask, _ = response_mask_from_ids(response, tokenizer.eos_token_id)
    sampled = torch.stack([torch.log_softmax(step / 0.7, -1) for step in out.logits], 1)
    sampled = sampled.gather(-1, response.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        scored = score_sequences(model, prompt_ids, prompt_mask, response, mask, temperature=0.7)
    diff = torch.where(mask, (scored.logprobs - sampled).abs(), 0.0).max().item()
    assert diff < 1e-5
    assert scored.values.shape == response.shape


def test_generate_responses_shapes_and_decoding(tiny_model_dir):
    model = load_actor_critic(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    prompts = ["The plot was", "I think", "The movie was", "This film"]
    batch = generate_responses(model.policy, tokenizer, prompts, max_new_tokens=12)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    lengths = batch.response_mask.sum(dim=1)
    assert batch.response_ids.shape == (4, int(lengths.max())) and lengths.max() <= 12
    assert (batch.response_mask[:, 0]).all()
    # the checks below need rows that ended with EOS and rows that did not (the warm-started
    # model ends most reviews within 12 tokens; this seed gives both)
    assert batch.has_eos.any() and not batch.has_eos.all(), batch.has_eos
    texts = decode_responses(tokenizer, batch.response_ids, batch.response_mask)
    for row, mask, ended, length, text in zip(
        batch.response_ids, batch.response_mask, batch.has_eos, lengths.tolist(), texts, strict=True
    ):
        assert mask[:length].all() and not mask[length:].any()  # a prefix of the row
        # nothing after the first EOS counts, and padding is written there
        assert (row[~mask] == pad).all()
        if ended:  # the first EOS is the last token that counts, and the text stops before it
            assert row[length - 1] == eos and (row[: length - 1] != eos).all()
            assert tokenizer.eos_token in tokenizer.decode(row[:length])
            assert text == tokenizer.decode(row[: length - 1], skip_special_tokens=True)
        else:
            assert length == 12 and (row != eos).all()
            assert text == tokenizer.decode(row, skip_special_tokens=True)
        assert tokenizer.eos_token not in text and tokenizer.pad_token not in text
