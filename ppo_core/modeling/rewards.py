"""Rewards: functions that score whole texts, for rollouts and evaluation.

A scorer is a callable ``scorer(prompts, responses) -> Tensor [B] float32``: one score per
rollout, placed by the PPO loop on the last real response token (docs/design.md section 5). Responses
must be decoded only up to their first EOS, without special tokens, and keep their leading space
(byte-level BPE decodes " great." for the token "Ġgreat"), so that ``prompt + response`` is the
review as a reader sees it.

Built-in scorer: VADER sentiment (``vaderSentiment``), rule based and CPU only, so the embedded
default runs with no download. Its known weak spots (stacked adjectives, a ", but ... great"
clause that rescues a negative opening) are the ones PPO finds; docs/design.md section 8.
"""

from __future__ import annotations

import torch

from ppo_core.modeling.data import Prompt


def sentiment_scores(texts: list[str]) -> list[float]:
    """Return VADER's compound score (in [-1, 1], > 0 positive) for each text."""
    return SentimentScorer().score_texts(texts)


class SentimentScorer:
    """Score ``prompt + response`` with VADER's compound sentiment (range -1..1).

    Source: Hutto and Gilbert (2014), VADER; ``SentimentIntensityAnalyzer.polarity_scores``.
    """

    def __init__(self) -> None:
        # Imported here so that importing this module stays cheap.
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self._analyzer = SentimentIntensityAnalyzer()

    def score_texts(self, texts: list[str]) -> list[float]:
        """Return the compound score of each whole text."""
        return [float(self._analyzer.polarity_scores(text)["compound"]) for text in texts]

    def __call__(self, prompts: list[Prompt], responses: list[str]) -> torch.Tensor:
        """Return scores [B] float32 of the reviews ``prompts[i] + responses[i]``; after a chat
        prompt, of the response alone (the assistant's turn is the review)."""
        if len(prompts) != len(responses):
            raise ValueError(
                f"SentimentScorer: got {len(prompts)} prompts but {len(responses)} "
                "responses; pass one response per prompt."
            )
        texts = [
            (p if isinstance(p, str) else "") + r for p, r in zip(prompts, responses, strict=True)
        ]
        return torch.tensor(self.score_texts(texts), dtype=torch.float32)
