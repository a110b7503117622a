"""The actor-critic: the policy, its value head or critic, and which of its weights are
trained (:mod:`ppo_core.models.weights`); models loaded from folders, a LoRA adapter folder
as its base with the adapter merged in. The pass that scores responses with them:
:mod:`ppo_core.models.scoring`; plain Hugging Face loading: :mod:`ppo_core.models.causal_lm`.

Layer 2 (model I/O). Models come from local ``save_pretrained`` folders only; weights load from
safetensors, and a folder's own Python code runs only with ``trust_remote_code=True``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ppo_core.files import first_line, printable
from ppo_core.models.causal_lm import (
    from_pretrained_checked,
    fuse_activations,
    load_plain_causal_lm,
    logits_to_keep_kwargs,
    position_ids_from_mask,
    unwrap_model,
)
from ppo_core.models.folders import ADAPTER_CONFIG, ModelFolderError, check_model_folder
from ppo_core.models.lora import load_adapter_model
from ppo_core.models.weights import FullWeights, PolicyWeights

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["ActorCritic", "load_actor_critic", "load_causal_lm"]

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_DIR = "critic"


def load_causal_lm(
    path: str | Path,
    role: str = "policy",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """An ``AutoModelForCausalLM`` from a local folder, in eval mode (dropout off). A LoRA
    adapter folder written by this project loads as its recorded base with the adapter merged
    in (:func:`ppo_core.models.lora.load_adapter_model`)."""
    folder = check_model_folder(path, role)
    if (folder / ADAPTER_CONFIG).is_file():
        return load_adapter_model(folder, role, trust_remote_code, dtype)
    return load_plain_causal_lm(folder, role, trust_remote_code, dtype)


class ActorCritic(nn.Module):
    """A causal LM policy with a scalar value head on its trunk, or on a critic trunk of its own,
    or with no value model at all (``value_head=None``, for the critic-free estimators).

    ``forward`` returns ``(logits [B, L, V], values [B, L])``; ``values[:, t]`` estimates the return
    from the state that ends at token ``t``; without a value head ``values`` is ``None``.
    """

    def __init__(
        self,
        policy: PreTrainedModel,
        value_head: nn.Linear | None,
        critic: PreTrainedModel | None = None,
        weights: PolicyWeights | None = None,
    ):
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.critic = critic
        self.weights = weights or FullWeights()
        """Which of the policy's weights are trained: all, or a LoRA adapter (``policy`` is then
        a ``peft`` model)."""

    @property
    def has_critic(self) -> bool:
        """Whether this model computes values (a value head, on either trunk)."""
        return self.value_head is not None

    @property
    def causal_lm(self) -> nn.Module:
        """The Hugging Face causal LM that computes the policy: ``policy`` itself, or the model
        inside the ``peft`` wrapper (its LoRA layers in place)."""
        return unwrap_model(self.policy)

    @contextlib.contextmanager
    def sampling_model(self, merge_adapter: bool = True) -> Iterator[nn.Module]:
        """The causal LM to sample responses from, for the ``with`` block: :attr:`causal_lm`,
        or with LoRA and ``merge_adapter`` the same model with the adapter merged into copies
        of its weights (:meth:`ppo_core.models.lora.LoraWeights.sampling_model`). Sharded
        (FSDP) parameters must not be swapped: callers pass ``merge_adapter=False`` for them."""
        with self.weights.sampling_model(self.policy, merge_adapter) as model:
            yield model

    def shared_reference(self) -> nn.Module | None:
        """The starting policy as the frozen KL reference, sharing this policy's weights (LoRA:
        the adapter off, or the starting adapter in its place); None when the reference is a
        model of its own."""
        return self.weights.shared_reference(self.policy)

    def updating(self) -> contextlib.AbstractContextManager:
        """A ``with`` block around the update (LoRA: its adapters' dropout on)."""
        return self.weights.updating(self.policy)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int = 0
    ) -> tuple[Tensor, Tensor | None]:
        """With ``logits_to_keep=n > 0`` only the last ``n`` positions get logits (``[B, n, V]``);
        values always cover all ``L`` positions."""
        position_ids = position_ids_from_mask(attention_mask)
        out = self._policy_pass(input_ids, attention_mask, position_ids, logits_to_keep)
        if self.value_head is None:
            return out.logits, None
        if self.critic is None:
            return out.logits, self._head(out.hidden_states[-1])
        return out.logits, self._critic_values(input_ids, attention_mask, position_ids)

    def values(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The values alone, ``[B, L]``, as :meth:`forward` computes them: the critic's trunk
        only, or the policy's trunk with its output layer cut to the last position (a pass
        that needs no log-probabilities throws the logits away). A model without a value head
        is a ``ValueError``."""
        if self.value_head is None:
            raise ValueError("this actor-critic has no value head (model.critic=none)")
        position_ids = position_ids_from_mask(attention_mask)
        if self.critic is not None:
            return self._critic_values(input_ids, attention_mask, position_ids)
        out = self._policy_pass(input_ids, attention_mask, position_ids, logits_to_keep=1)
        return self._head(out.hidden_states[-1])

    def _policy_pass(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, logits_to_keep: int
    ):
        """The causal LM's output, with its hidden states when the value head sits on its trunk."""
        return self.causal_lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=self.has_critic and self.critic is None,
            use_cache=False,
            **logits_to_keep_kwargs(self.causal_lm, logits_to_keep),
        )

    def _critic_values(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor):
        hidden = cast("nn.Module", self.critic)(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        return self._head(hidden)

    def _head(self, hidden: Tensor) -> Tensor:
        head = cast("nn.Linear", self.value_head)
        # a new tensor, not a view: FSDP's backward hooks are lost on views of a root's output
        return head(hidden.to(head.weight.dtype))[..., 0].clone()

    def save(
        self,
        folder: str | Path,
        tokenizer=None,
        merged: bool = False,
        full_state: dict[str, Tensor] | None = None,
    ) -> None:
        """Write ``save_pretrained`` folders (safetensors) plus the value head, into ``folder``.

        The policy is written as :attr:`weights` say (:meth:`PolicyWeights.save`): a LoRA policy
        as its adapter, or with ``merged`` as a whole model with the adapter merged in; merging
        in place takes the adapter out of this model (it is a whole model afterwards), so it is
        for the final save only. ``full_state``: this module's whole state dict when its own
        parameters are shards (FSDP), gathered by ``ppo_core.parallel.strategies``; the files are then
        written from it."""
        folder = Path(folder)
        if full_state is not None:
            self._save_gathered(folder, full_state, merged)
        else:
            policy = self.weights.save(self.policy, folder, merged)
            if policy is not self.policy:  # merged in place: every weight is the model's now
                self.policy, self.weights = cast("PreTrainedModel", policy), FullWeights()
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if full_state is not None or self.value_head is None:
            return
        save_file(
            {k: v.detach().contiguous() for k, v in self.value_head.state_dict().items()},
            str(folder / VALUE_HEAD_FILE),
        )
        if self.critic is not None:
            self.critic.save_pretrained(folder / CRITIC_DIR, safe_serialization=True)

    def describe(self, folder: str | Path, tokenizer=None) -> None:
        """Write the policy's config (and ``tokenizer``) into ``folder``, without weights: the
        model folder of a sharded checkpoint, whose weights are in its shards."""
        config: Any = getattr(self.causal_lm, "config")  # noqa: B009 (typed as Any)
        config.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    def _save_gathered(self, folder: Path, full_state: dict[str, Tensor], merged: bool) -> None:
        def part(prefix: str) -> dict[str, Tensor]:
            return {
                k[len(prefix) :]: v.contiguous()
                for k, v in full_state.items()
                if k.startswith(prefix)
            }

        # tied weights (GPT-2's output layer is its embedding) are one parameter under two
        # names; gathered, they are two tensors, and the model is saved with the first name only
        tied, seen = set(), set()
        for name, tensor in self.policy.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                tied.add(name)
            seen.add(id(tensor))
        policy_state = {k: v for k, v in part("policy.").items() if k not in tied}
        self.weights.save(self.policy, folder, merged, state_dict=policy_state)
        if self.value_head is not None:
            save_file(part("value_head."), str(folder / VALUE_HEAD_FILE))
        if self.critic is not None:
            self.critic.save_pretrained(
                folder / CRITIC_DIR, state_dict=part("critic."), safe_serialization=True
            )


def load_actor_critic(
    path: str | Path,
    critic: str = "shared",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    weights: PolicyWeights | None = None,
) -> ActorCritic:
    """Policy (and critic) from a folder; the value head is loaded when the folder has one and
    initialised to zero otherwise (so the first values are 0, not noise). With ``critic="none"``
    there is no value head, and a folder's ``value_head.safetensors`` is not read.

    ``weights`` (default :class:`FullWeights`: every weight) say which weights are trained and
    what the policy is built on: with :class:`ppo_core.models.lora.LoraWeights` it is the
    model in its base (``model.policy``) with a trainable LoRA adapter, the one in ``path``
    when it is an adapter folder (a checkpoint, or a starting adapter), else a fresh one."""
    from transformers import AutoModel

    weights = weights or FullWeights()
    folder = check_model_folder(path, "policy")
    model = load_causal_lm(
        weights.model_folder(folder), weights.model_role, trust_remote_code, dtype
    )
    policy: Any = weights.attach(model, folder)
    hidden = _hidden_size(policy.config)
    critic_trunk: PreTrainedModel | None = None
    if critic == "separate":
        critic_folder = folder / CRITIC_DIR
        if critic_folder.is_dir():
            check_model_folder(critic_folder, "critic")
        else:  # a fresh critic starts from the policy's weights (already checked)
            critic_folder = folder
        critic_trunk = fuse_activations(
            from_pretrained_checked(
                AutoModel, critic_folder, "critic", dtype=dtype, trust_remote_code=trust_remote_code
            )
        ).eval()
        hidden = _hidden_size(critic_trunk.config)
    if critic == "none":
        return ActorCritic(policy, None, None, weights).eval()
    value_head = nn.Linear(hidden, 1, dtype=torch.float32)
    head_file = folder / VALUE_HEAD_FILE
    if head_file.is_file():
        state = _value_head_state(head_file)
        if state["weight"].shape != value_head.weight.shape:
            raise ModelFolderError(
                f"{head_file} holds a value head of shape {tuple(state['weight'].shape)}, the "
                f"model needs {tuple(value_head.weight.shape)}"
            )
        value_head.load_state_dict(state)
    else:
        nn.init.zeros_(value_head.weight)
        nn.init.zeros_(value_head.bias)
    return ActorCritic(policy, value_head, critic_trunk, weights).eval()


def _value_head_state(head_file: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``value_head.safetensors``; a damaged file, or one without ``weight`` and
    ``bias``, is one :class:`ModelFolderError` naming it."""
    from safetensors import SafetensorError

    try:
        state = load_file(str(head_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelFolderError(f"{head_file} is damaged: {printable(first_line(exc))}") from None
    if set(state) != {"weight", "bias"}:
        raise ModelFolderError(
            f"{head_file} holds {sorted(printable(k) for k in state)}, not a value head's "
            "weight and bias"
        )
    return state


def _hidden_size(config) -> int:
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ModelFolderError(f"cannot tell the hidden size of a {type(config).__name__}")
