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

Verifiers, which take the row's ``answer`` reference field as a keyword
(:mod:`ppo_core.rewards.verifiers`): ``builtin:exact_match`` (the normalised final answer) and
``builtin:math_answer`` (math-verify, symbolically, each reply bounded in time), and
``builtin:reasoning_gym``, a reasoning-gym task's own scorer (:mod:`ppo_core.rewards.gym`).
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


@builtin_reward("builtin:exact_match")
class ExactMatchReward:
    """1.0 where the reply's final answer equals the row's ``answer`` field, both normalised
    (:func:`ppo_core.rewards.verifiers.exact_match`); 0.0 otherwise. Each call's reasons
    (``correct``, ``wrong``, ``empty``) are counted in :attr:`last_reasons`."""

    def __init__(self) -> None:
        self.last_reasons: dict[str, int] = {}

    def __call__(
        self, prompts: list[Prompt], responses: list[str], *, answer: list
    ) -> torch.Tensor:
        from ppo_core.rewards.verifiers import exact_match

        verdicts = [exact_match(r, str(a)) for r, a in zip(responses, answer, strict=True)]
        return _scored(self, verdicts)


@builtin_reward("builtin:math_answer")
class MathAnswerReward:
    """1.0 where the reply's final answer (its last ``\\boxed{}``, ``####`` or "answer is")
    equals the row's ``answer`` field symbolically, by math-verify in a worker process, each
    reply within :data:`MATH_SECONDS` (:class:`ppo_core.rewards.verifiers.MathAnswerChecker`);
    0.0 otherwise. Reasons (``correct``, ``wrong``, ``unparsed``, ``timeout``, ``error``) are
    counted in :attr:`last_reasons`."""

    def __init__(self) -> None:
        from ppo_core.rewards.verifiers import MathAnswerChecker

        self.checker = MathAnswerChecker(seconds=MATH_SECONDS)
        self.last_reasons: dict[str, int] = {}

    def __call__(
        self, prompts: list[Prompt], responses: list[str], *, answer: list
    ) -> torch.Tensor:
        verdicts = [self.checker.check(r, str(a)) for r, a in zip(responses, answer, strict=True)]
        return _scored(self, verdicts)


@builtin_reward("builtin:reasoning_gym")
class ReasoningGymReward:
    """A reasoning-gym task's own scorer on the reply's ``<answer>...</answer>``, against the
    row's ``answer``, ``task`` and ``metadata`` reference fields (rows written by ``ppo tasks``;
    :mod:`ppo_core.rewards.gym`). Reasons (``correct``, ``wrong``, ``unparsed``, ``error``) are
    counted in :attr:`last_reasons`."""

    def __init__(self) -> None:
        self.last_reasons: dict[str, int] = {}

    def __call__(
        self,
        prompts: list[Prompt],
        responses: list[str],
        *,
        answer: list,
        task: list,
        metadata: list | None = None,
    ) -> torch.Tensor:
        from ppo_core.rewards.gym import gym_verdict

        extra = metadata if metadata is not None else [None] * len(responses)
        verdicts = [
            gym_verdict(r, str(a), str(t), m)
            for r, a, t, m in zip(responses, answer, task, extra, strict=True)
        ]
        return _scored(self, verdicts)


MATH_SECONDS = 5.0
"""Longest ``builtin:math_answer`` spends on one reply (math-verify's own default)."""


def _scored(reward, verdicts) -> torch.Tensor:
    """The verdicts' scores as a float32 tensor, their reasons counted on ``reward``."""
    reasons: dict[str, int] = {}
    for verdict in verdicts:
        reasons[verdict.reason] = reasons.get(verdict.reason, 0) + 1
    reward.last_reasons = reasons
    return torch.tensor([verdict.score for verdict in verdicts], dtype=torch.float32)
