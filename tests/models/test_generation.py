import torch

from ppo_core.models.causal_lm import load_tokenizer
from ppo_core.models.generation import (
    decode_responses,
    generate_responses,
    response_mask_from_ids,
)
from ppo_core.models.policy import load_actor_critic
from ppo_core.models.scoring import score_sequences


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


def test_generate_responses_shapes_and_decoding(tiny_model_dir):
    model = load_actor_critic(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    torch.manual_seed(1)
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


def test_sampling_follows_the_configured_distribution_whatever_the_model_s_own_settings(
    tiny_model_dir, tmp_path
):
    """A checkpoint's generation_config.json may ask for a top-k, a repetition penalty, banned
    n-grams, suppressed tokens or a min-p, and transformers fills an unset top-k with 50: none of
    it may shape what PPO samples, or the sampled tokens would not follow the logprobs it
    computes. The sampler keeps each token's log-probability under the raw logits over the
    temperature, the scoring pass's; and it draws tokens that the model's own settings forbid."""
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = load_tokenizer(folder)
    suppressed = set(range(10, 300))
    own = GenerationConfig(
        do_sample=True,
        top_k=3,
        top_p=0.5,
        min_p=0.3,
        repetition_penalty=1.5,
        no_repeat_ngram_size=1,
        suppress_tokens=sorted(suppressed),
        bad_words_ids=[[70], [71]],
        eos_token_id=tokenizer.eos_token_id,
    )
    own.save_pretrained(folder)
    model = load_actor_critic(folder)
    assert model.policy.generation_config.top_k == 3  # the model came with its own settings
    torch.manual_seed(0)
    prompts = ["The movie was", "This film", "I think", "The plot was"] * 4
    batch = generate_responses(model.policy, tokenizer, prompts, max_new_tokens=8, temperature=0.7)
    drawn = set(batch.response_ids[batch.response_mask].tolist())
    assert drawn & suppressed, drawn  # measured: 9 of the 41 distinct tokens drawn
    with torch.no_grad():
        scored = score_sequences(
            model,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.response_ids,
            batch.response_mask,
            temperature=0.7,
        )
    kept = batch.logprobs[batch.response_mask]
    # measured: 4.8e-6 (the cached step-by-step forward against the whole-sequence one)
    torch.testing.assert_close(kept, scored.logprobs[batch.response_mask], rtol=0, atol=1e-5)
    assert (batch.logprobs[~batch.response_mask] == 0).all()
    assert model.policy.generation_config.top_k == 3  # and keeps them for when it is saved


def test_the_mask_ends_at_the_first_of_several_stop_ids():
    ids = torch.tensor([[5, 9, 2, 7], [5, 6, 9, 2], [5, 6, 7, 8]])
    mask, has_eos = response_mask_from_ids(ids, [2, 9])
    assert mask.tolist() == [
        [True, True, False, False],
        [True, True, True, False],
        [True, True, True, True],
    ]
    assert has_eos.tolist() == [True, True, False]


def test_a_response_stops_at_an_end_of_turn_id_the_model_s_generation_config_lists(
    tiny_model_dir,
):
    """Chat models list their end-of-turn token (``<|im_end|>``, ``<|eot_id|>``) beside EOS in
    generation_config.json: a response ends at the first of them, though sampling sets the
    model's own config aside. Sampled twice with one seed, the second time with an extra stop
    id that the first sample drew, the rows agree up to that id and end there."""
    from ppo_core.models.generation import stop_token_ids

    model = load_actor_critic(tiny_model_dir).policy
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = ["The plot was", "I think", "The movie was", "This film"]
    torch.manual_seed(3)
    free = generate_responses(model, tokenizer, prompts, max_new_tokens=12)
    extra = int(free.response_ids[0, 1])  # the second token of the first row
    assert extra != tokenizer.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, extra]
    assert stop_token_ids(model, tokenizer) == [tokenizer.eos_token_id, extra]
    torch.manual_seed(3)
    stopped = generate_responses(model, tokenizer, prompts, max_new_tokens=12)
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, extra]  # kept
    lengths = stopped.response_mask.sum(dim=1)
    assert lengths[0] == 2 and stopped.has_eos[0]
    for row in range(len(prompts)):
        length = int(lengths[row])
        assert (
            stopped.response_ids[row, :length].tolist() == free.response_ids[row, :length].tolist()
        )
        first_stop = [
            i
            for i, t in enumerate(free.response_ids[row].tolist())
            if t in (extra, tokenizer.eos_token_id)
        ]
        assert length == (first_stop[0] + 1 if first_stop else 12)
