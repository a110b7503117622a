"""Tests of the embedded tiny default: tokenizer, model config, build, and the VADER scorer."""

from __future__ import annotations

import json

import pytest
import torch

from ppo_core.base_sources.review_grammar import generate_review_corpus
from ppo_core.base_sources.tiny_default import build_tiny_default, tiny_gpt2_config, train_tokenizer
from ppo_core.rewards.scorers import SentimentScorer


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return generate_review_corpus(3000, seed=0)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_tokenizer(corpus, vocab_size=1024)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A fast build (few steps, small corpus) shared by the build tests."""
    root = tmp_path_factory.mktemp("build")
    path = build_tiny_default(root / "tiny", seed=0, n_sentences=2000, steps=30, num_threads=1)
    return root, path


# ---- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_special_tokens(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.unk_token == "<|unk|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"
    assert len(tokenizer) <= 1024


def test_tokenizer_round_trips_text_and_prepends_bos(tokenizer, corpus):
    for text in [*corpus[:50], "Zebras énjoy unseen wörds!"]:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.eos_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # A response decodes with its leading space, so prompt + response is the review.
    prompt, full = "The movie was", "The movie was great."
    response_ids = tokenizer(full)["input_ids"][len(tokenizer(prompt)["input_ids"]) :]
    assert prompt + tokenizer.decode(response_ids) == full


def test_tokenizer_left_pads_a_batch(tokenizer):
    batch = tokenizer(["The plot", "I thought the acting was"], padding=True)
    first, mask = batch["input_ids"][0], batch["attention_mask"][0]
    n_pad = mask.count(0)
    assert n_pad > 0 and first[:n_pad] == [tokenizer.pad_token_id] * n_pad
    assert first[n_pad] == tokenizer.bos_token_id


def test_tokenizer_save_and_load(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Frankly, the plot was dull, but the cast was great."
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)


def test_config_has_no_dropout_and_the_special_ids():
    config = tiny_gpt2_config(500, n_positions=32, n_layer=1)
    assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (0.0, 0.0, 0.0)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert (config.vocab_size, config.n_positions, config.n_layer, config.n_embd) == (
        500,
        32,
        1,
        128,
    )


# ---- build ----------------------------------------------------------------------------------


def test_build_writes_a_loadable_folder(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    root, path = built
    assert path == (root / "tiny").resolve()
    assert (path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.n_layer == 2 and model.config.n_embd == 128
    assert model.config.vocab_size == len(tok)
    gen = GenerationConfig.from_pretrained(path)
    assert (gen.do_sample, gen.top_k, gen.top_p, gen.temperature) == (True, 0, 1.0, 1.0)
    assert gen.eos_token_id == tok.eos_token_id and gen.pad_token_id == tok.pad_token_id

    record = json.loads((path / "tiny_default.json").read_text())
    assert record["seed"] == 0 and record["steps"] == 30 and record["n_sentences"] == 2000
    # the warm start learned: cross-entropy fell from about ln(vocab) by a clear margin
    assert record["initial_loss"] > 5.0
    assert record["final_loss"] < record["initial_loss"] - 1.0

    batch = tok(["The movie was", "I thought the plot"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=4)
    assert out.shape[0] == 2 and out.shape[1] <= batch["input_ids"].shape[1] + 4


def test_build_leaves_no_temporary_folder_and_replaces_atomically(built):
    root, path = built
    assert [p.name for p in root.iterdir()] == ["tiny"]
    before = (path / "model.safetensors").read_bytes()
    # Rebuilding over an existing folder replaces it (same seed: same weights) and cleans up.
    build_tiny_default(path, seed=0, n_sentences=2000, steps=30, num_threads=1)
    assert [p.name for p in root.iterdir()] == ["tiny"]
    assert (path / "model.safetensors").read_bytes() == before  # deterministic in the seed
    with pytest.raises(FileExistsError):
        build_tiny_default(path, steps=1, n_sentences=100, overwrite=False)


def test_failed_build_leaves_nothing_behind(tmp_path):
    with pytest.raises(ValueError, match="n_positions"):
        build_tiny_default(tmp_path / "tiny", n_sentences=200, steps=1, n_positions=4)
    assert list(tmp_path.iterdir()) == []


# ---- scorer ---------------------------------------------------------------------------------


def test_scorer_shape_dtype_and_sign():
    scorer = SentimentScorer()
    prompts = ["The movie was", "I thought the acting", "The plot"]
    responses = [" wonderful and fun. I loved it.", " was terrible and boring.", " was long."]
    scores = scorer(prompts, responses)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert scores[0] > 0.5 and scores[1] < -0.5 and scores[2] == 0.0
    assert torch.all(scores.abs() <= 1.0)
    # The whole review counts: the score is that of prompt + response, so the same response
    # after a different prompt scores differently.
    assert (
        scorer(["The movie was"], [" great."])[0]
        == SentimentScorer().score_texts(["The movie was great."])[0]
    )
    assert (
        scorer(["The movie was not"], [" great."])[0]
        < 0
        < scorer(["The movie was"], [" great."])[0]
    )


def test_scorer_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        SentimentScorer()(["a", "b"], ["c"])
