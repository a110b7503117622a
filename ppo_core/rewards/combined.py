"""Several rewards as one: ``model.reward`` and the shaping terms ``model.reward_terms``,
weighed by ``model.reward_weights`` (layer 2), as TRL's ``reward_funcs`` and ``reward_weights``.

The score of a reply is ``sum_i w_i * r_i(prompt, reply)``; each term's own scores are kept
for the logs (``reward/<name>``). Evaluation and the gate judge with ``model.reward`` alone:
a format or length term shapes training, and is no measure of the task.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

import torch
from torch import Tensor

from ppo_core.prompts import Prompt

__all__ = ["WeightedReward", "metric_name", "term_names"]

_NOT_NAME = re.compile(r"[^a-z0-9_]+")


def metric_name(text: str, prefix: str) -> str:
    """``text`` as the name part of a metric (``[a-z][a-z0-9_]*``): lower case, other
    characters runs of ``_``; ``prefix`` + ``_`` before one that does not start with a letter."""
    name = _NOT_NAME.sub("_", text.lower()).strip("_")
    return name if name[:1].isalpha() else f"{prefix}_{name}".rstrip("_")


def term_names(specs: Sequence[str]) -> list[str]:
    """A metric name for each reward spec, distinct: ``builtin:math_answer`` -> ``math_answer``,
    ``checks:has_format`` -> ``has_format``, a folder -> its last part, ``reward:r0002`` ->
    ``reward_r0002``; a repeated name gains ``_2``, ``_3``, ... (metric names are
    ``[a-z][a-z0-9_]*``)."""
    names: list[str] = []
    for spec in specs:
        if spec.startswith("reward:"):
            raw = spec.replace(":", "_")
        elif ":" in spec and not PurePath(spec).is_absolute():
            raw = spec.rpartition(":")[2]
        else:
            raw = PurePath(spec).name
        name = metric_name(raw, "r")
        unique, count = name, 1
        while unique in names:
            count += 1
            unique = f"{name}_{count}"
        names.append(unique)
    return names


class WeightedReward:
    """``sum_i weights[i] * rewards[i](prompts, responses, references)`` ``[B]`` float32.

    ``rewards`` are loaded reward functions (:func:`~ppo_core.rewards.loading.build_reward_fn`,
    each checked and time-limited on its own), ``names`` their metric names. After a call,
    ``last_terms`` maps each name to its unweighted scores ``[B]``, and ``last_reasons`` sums
    the verdict reasons of the terms that give them (a verifier)."""

    def __init__(
        self, rewards: Sequence[Any], weights: Sequence[float], names: Sequence[str]
    ) -> None:
        if not (len(rewards) == len(weights) == len(names)) or not rewards:
            raise ValueError(
                f"{len(rewards)} rewards, {len(weights)} weights and {len(names)} names: one "
                "weight and one name a reward"
            )
        self.rewards = list(rewards)
        self.weights = [float(w) for w in weights]
        self.names = list(names)
        self.last_terms: dict[str, Tensor] = {}

    def __call__(
        self,
        prompts: list[Prompt],
        responses: list[str],
        references: Mapping[str, Sequence[Any]] | None = None,
    ) -> Tensor:
        total = torch.zeros(len(responses), dtype=torch.float32)
        terms: dict[str, Tensor] = {}
        for reward, weight, name in zip(self.rewards, self.weights, self.names, strict=True):
            scores = reward(prompts, responses, references)
            terms[name] = scores
            total += weight * scores
        self.last_terms = terms
        return total

    @property
    def last_reasons(self) -> dict[str, int]:
        reasons: dict[str, int] = {}
        for reward in self.rewards:
            found = getattr(getattr(reward, "source", reward), "last_reasons", None)
            for reason, count in (found or {}).items():
                reasons[reason] = reasons.get(reason, 0) + count
        return reasons

    @property
    def source(self) -> WeightedReward:
        """Itself: what :func:`~ppo_core.rewards.verifiers.reason_counts` reads reasons from."""
        return self
