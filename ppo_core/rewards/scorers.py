"""Rewards: functions that score whole texts, for rollouts and evaluation.

A scorer is a callable ``scorer(prompts, responses) -> Tensor [B] float32``: one score per
rollout, placed by the PPO loop on the last real response token (docs/design.md section 5). Responses
must be decoded only up to their first EOS, without special tokens, and keep their leading space
(byte-level BPE decodes " great." for the token "Ġgreat"), so that ``prompt + response`` is the
review as a reader sees it.

Built-in scorers, both rule based and CPU only, so that nothing is downloaded:

- ``builtin:sentiment``, VADER (``vaderSentiment``), the default reward. Its known weak spots
  (stacked adjectives, a ", but ... great" clause that rescues a negative opening) are the ones
  PPO finds; docs/design.md section 8.
- ``builtin:afinn``, the AFINN-165 word list (``afinn``), a second, independent lexicon for the
  promotion gate's check (``promote.check_reward``): a policy that learnt one lexicon's quirks is
  not rewarded for them by the other. Both still reward a repeated positive word; the gate's
  distinct-2 guard is the one that catches repetition.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ppo_core.catalog import Catalog
from ppo_core.prompts import Prompt

BUILTIN_REWARDS: Catalog = Catalog("built-in reward", Path(__file__), "builtin_reward")
"""The rewards ``model.reward=builtin:<name>`` names: each a class of this file under
``@builtin_reward("builtin:<name>")``, built with no argument and called as a reward function."""

builtin_reward = BUILTIN_REWARDS.register


@builtin_reward("builtin:sentiment")
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


@builtin_reward("builtin:afinn")
class AfinnScorer(SentimentScorer):
    """Score ``prompt + response`` with the AFINN-165 word list: the sum of the valences (-5..+5)
    of the words it lists, squashed to (-1, 1) by ``tanh(sum / 5)`` so that one clearly positive
    word scores about +0.5, as on VADER's scale.

    Source: Nielsen (2011), "A new ANEW: evaluation of a word list for sentiment analysis in
    microblogs" (arXiv:1103.2903); ``afinn.Afinn(language="en").score``."""

    def __init__(self) -> None:
        try:
            from afinn import Afinn
        except ImportError:
            raise ImportError(
                "builtin:afinn needs the afinn package (`pip install afinn`; `make setup` "
                "installs it)"
            ) from None
        self._afinn = Afinn(language="en")

    def score_texts(self, texts: list[str]) -> list[float]:
        """Return ``tanh(sum of valences / 5)`` of each whole text."""
        return [math.tanh(self._afinn.score(text) / 5.0) for text in texts]
