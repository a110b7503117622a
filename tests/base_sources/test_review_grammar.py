"""Tests of the review grammar: the corpus of the tiny default and its neutral prompts."""

from __future__ import annotations

import pytest
import torch

from ppo_core.base_sources.review_grammar import (
    _NEGATIVE,
    _NEUTRAL,
    _POSITIVE,
    default_prompts,
    generate_review_corpus,
)
from ppo_core.rewards.scorers import SentimentScorer


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return generate_review_corpus(3000, seed=0)


def test_corpus_is_deterministic_in_seed(corpus):
    assert generate_review_corpus(3000, seed=0) == corpus
    assert generate_review_corpus(3000, seed=1) != corpus


def test_corpus_items_are_reviews_ending_with_a_period(corpus):
    assert len(corpus) == 3000
    assert all(text.endswith(".") and text[0].isupper() for text in corpus)
    words = {w.strip(".,").lower() for text in corpus for w in text.split()}
    assert 100 <= len(words) <= 600  # a moderate vocabulary a tiny model learns quickly


def test_corpus_sentiment_is_mixed_and_slightly_positive(corpus):
    scores = torch.tensor(SentimentScorer().score_texts(corpus))
    positive = (scores > 0.05).float().mean().item()
    negative = (scores < -0.05).float().mean().item()
    # Targets: about 45% positive, 31% negative, the rest neutral; mean compound about 0.1.
    assert 0.35 < positive < 0.55
    assert 0.22 < negative < 0.40
    assert 0.0 < scores.mean().item() < 0.2


def test_word_lists_agree_with_the_scorer():
    # The grammar's polarity labels are VADER's: each adjective alone scores with its sign.
    assert all(s > 0 for s in SentimentScorer().score_texts(list(_POSITIVE)))
    assert all(s < 0 for s in SentimentScorer().score_texts(list(_NEGATIVE)))
    assert all(s == 0 for s in SentimentScorer().score_texts(list(_NEUTRAL)))


def test_default_prompts_are_distinct_short_neutral_and_prefix_stable():
    prompts = default_prompts(300, seed=0)
    assert len(set(prompts)) == 300
    assert all(2 <= len(p.split()) <= 5 and p == p.strip() for p in prompts)
    assert all(s == 0.0 for s in SentimentScorer().score_texts(prompts))
    assert default_prompts(300, seed=0) == prompts
    assert default_prompts(364, seed=0)[:300] == prompts  # held-out = the extension
    assert default_prompts(300, seed=1) != prompts


def test_default_prompts_rejects_more_than_the_pool():
    with pytest.raises(ValueError, match="pool holds"):
        default_prompts(100_000, seed=0)
