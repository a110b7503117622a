"""Which of the policy's weights a run trains (layer 2): every weight (:class:`FullWeights`), or
a LoRA adapter on a frozen base (:class:`ppo_core.models.lora.LoraWeights`).

:class:`ppo_core.models.policy.ActorCritic` holds one and asks it, never which one it is, how
to build the trainable policy on a loaded model, what to sample from, whether the KL reference
can share the policy's weights, how to save, and what to switch on for the update: the way
:class:`ppo_core.parallel.strategies.ParallelStrategy` answers for how the models are spread over ranks.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ppo_core.models.causal_lm import unwrap_model

__all__ = ["FullWeights", "PolicyWeights"]


class PolicyWeights(ABC):
    """How the policy's trained weights are held, loaded, sampled, referenced and saved."""

    adapter_base: Path | None = None
    """The frozen base model folder the trained weights apply to; None when they are the whole
    model."""
    model_role: str = "policy"
    """The config key or role that names :meth:`model_folder` in errors."""

    @abstractmethod
    def model_folder(self, folder: Path) -> Path:
        """The folder of the model the policy is built on, for a start or checkpoint ``folder``."""

    @abstractmethod
    def attach(self, model: nn.Module, folder: Path) -> nn.Module:
        """The trainable policy on ``model`` (loaded from :meth:`model_folder`), taking what
        ``folder`` holds of the trained weights."""

    @abstractmethod
    def sampling_model(self, policy: nn.Module, merge: bool) -> contextlib.AbstractContextManager:
        """A ``with`` block yielding the causal LM to sample responses from; ``merge``: whether
        the weights may be swapped for merged copies (not while sharded)."""

    @abstractmethod
    def shared_reference(self, policy: nn.Module) -> nn.Module | None:
        """The starting policy as the frozen KL reference, sharing ``policy``'s weights; None
        when the reference must be loaded as a model of its own."""

    @abstractmethod
    def save(
        self,
        policy: nn.Module,
        folder: Path,
        merged: bool,
        state_dict: dict[str, Tensor] | None = None,
    ) -> nn.Module:
        """Write the trained policy into ``folder`` (``save_pretrained`` files), from
        ``state_dict`` when given (gathered from shards); ``merged``: as a whole model. Returns
        the policy to keep using (a merge may replace it)."""

    def updating(self, policy: nn.Module) -> contextlib.AbstractContextManager:
        """A ``with`` block around the update: what trains differently from scoring (none
        unless overridden)."""
        return contextlib.nullcontext()


class FullWeights(PolicyWeights):
    """Every weight of the policy is trained; the model folder is the policy."""

    def model_folder(self, folder: Path) -> Path:
        return folder

    def attach(self, model: nn.Module, folder: Path) -> nn.Module:
        return model

    @contextlib.contextmanager
    def sampling_model(self, policy: nn.Module, merge: bool) -> Iterator[nn.Module]:
        yield unwrap_model(policy)

    def shared_reference(self, policy: nn.Module) -> nn.Module | None:
        return None

    def save(
        self,
        policy: nn.Module,
        folder: Path,
        merged: bool,
        state_dict: dict[str, Tensor] | None = None,
    ) -> nn.Module:
        model: Any = policy
        extra = {} if state_dict is None else {"state_dict": state_dict}
        model.save_pretrained(folder, safe_serialization=True, **extra)
        return policy
