"""Loading the policy, critic and reference models (the pass that scores responses with them:
:mod:`ppo_core.modeling.scoring`).

Layer 2 (model I/O). Models come from local ``save_pretrained`` folders only; weights load from
safetensors, and a folder's own Python code runs only with ``trust_remote_code=True``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import shutil
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor, nn

from ppo_core.files import first_line
from ppo_core.modeling.folders import ADAPTER_CONFIG, ModelFolderError, check_model_folder

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ppo_core.modeling.lora import LoraSettings

__all__ = [
    "ActorCritic",
    "ModelFolderError",
    "check_model_folder",
    "checkpoint_blocks",
    "fuse_activations",
    "load_actor_critic",
    "load_causal_lm",
    "load_tokenizer",
    "logits_to_keep_kwargs",
    "position_ids_from_mask",
    "transformer_blocks",
    "unwrap_model",
]

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_DIR = "critic"
_STRUCTURE_ONLY = contextvars.ContextVar("structure_only", default=False)


@contextlib.contextmanager
def structure_only() -> Iterator[None]:
    """Within it, models are built from their folder's config on the meta device, reading no
    weights: the ranks of a sharded run other than rank 0 build the structure this way and
    receive their shards from rank 0 (``ppo_core.parallel``)."""
    token = _STRUCTURE_ONLY.set(True)
    try:
        yield
    finally:
        _STRUCTURE_ONLY.reset(token)


def from_pretrained_checked(loader, folder: Path, role: str, **kwargs):
    """``loader.from_pretrained(folder, use_safetensors=True, ...)``, its failures turned into one
    :class:`ModelFolderError` that names the role and folder (a folder whose code would have to
    run without ``trust_remote_code``, a config transformers does not know, damaged weights).
    Within :func:`structure_only`, the model of the folder's config on the meta device."""
    try:
        if _STRUCTURE_ONLY.get():
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(
                folder, trust_remote_code=kwargs.get("trust_remote_code", False)
            )
            with torch.device("meta"):
                return loader.from_config(config, **kwargs)
        return loader.from_pretrained(folder, use_safetensors=True, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelFolderError(
            f"cannot load {role} from {str(folder)!r}: {first_line(exc)}"
        ) from None


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The tokenizer of a model folder, set up for left-padded prompts with a pad token."""
    from transformers import AutoTokenizer

    folder = check_model_folder(path, "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.eos_token_id is None:
        raise ModelFolderError(f"the tokenizer in {str(folder)!r} has no EOS token")
    if tokenizer.pad_token_id is None:
        # Llama, Mistral and Pythia tokenizers ship without one. Padding with EOS is exact here:
        # masks come from the attention mask and the first EOS of a response, never from the
        # pad id, so the EOS that ends a response still counts and is rewarded.
        tokenizer.pad_token = tokenizer.eos_token
        warnings.warn(
            f"the tokenizer in {str(folder)!r} has no pad token: padding with its EOS token "
            f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id}); models saved from this run "
            "keep that choice",
            PadTokenWarning,
            stacklevel=2,
        )
    return tokenizer


class PadTokenWarning(UserWarning):
    """A tokenizer without a pad token pads with its EOS token."""


def load_causal_lm(
    path: str | Path,
    role: str = "policy",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """An ``AutoModelForCausalLM`` from a local folder, in eval mode (dropout off). A LoRA
    adapter folder written by this project loads as its recorded base with the adapter merged
    in (:func:`ppo_core.modeling.lora.load_adapter_model`)."""
    from transformers import AutoModelForCausalLM

    folder = check_model_folder(path, role)
    if (folder / ADAPTER_CONFIG).is_file():
        from ppo_core.modeling.lora import load_adapter_model

        return load_adapter_model(
            folder, lambda base: load_causal_lm(base, role, trust_remote_code, dtype), role
        )
    model = from_pretrained_checked(
        AutoModelForCausalLM, folder, role, dtype=dtype, trust_remote_code=trust_remote_code
    )
    return fuse_activations(model).eval()


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def fuse_activations(model: ModuleT) -> ModuleT:
    """Swap the tanh-approximated GELU written as Python tensor ops (``NewGELUActivation``, GPT-2's
    ``gelu_new``) for PyTorch's fused ``gelu(approximate="tanh")``, in place; returns ``model``.

    Same formula (Hendrycks & Gimpel 2016, eq. for the tanh approximation), one kernel instead of
    seven, so forward and backward passes are faster and keep fewer activations; outputs differ by
    float round-off only. The config is untouched, so saved folders are as they were loaded.
    """
    from transformers.activations import GELUTanh, NewGELUActivation

    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is NewGELUActivation:
                setattr(parent, name, GELUTanh())
    return model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks inside ``model``: instances of the classes that its Hugging Face
    models list in ``_no_split_modules`` (``LlamaDecoderLayer``, ``GPT2Block``, ...)."""
    kinds = {
        name
        for module in model.modules()
        for name in (getattr(module, "_no_split_modules", None) or ())
    }
    return [module for module in model.modules() if type(module).__name__ in kinds]


def checkpoint_blocks(model: nn.Module) -> int:
    """Non-reentrant activation checkpointing of every transformer block in ``model`` (the
    classes its Hugging Face models list in ``_no_split_modules``); returns how many blocks.

    While gradients are recorded a block keeps only its inputs, and its forward pass runs again
    during the backward pass (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
    Cost"; ``torch.utils.checkpoint`` with ``use_reentrant=False``, which also serves
    frozen-weight blocks under LoRA). Unlike transformers' own switch this does not depend on
    train mode, which PPO leaves off (dropout stays off), and gradient-free passes (sampling,
    scoring) run as before. Same gradients up to float round-off.
    """
    from torch.utils.checkpoint import checkpoint

    blocks = transformer_blocks(model)
    if not blocks:
        raise ModelFolderError(
            f"train.gradient_checkpointing: found no transformer blocks in a "
            f"{type(model).__name__} (its models name none in _no_split_modules)"
        )
    for block in blocks:
        if block in _CHECKPOINTED:
            continue
        forward = block.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed
        _CHECKPOINTED.add(block)
    return len(blocks)


_CHECKPOINTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1``, clamped at 0. ``[B, L] -> [B, L]``.

    Generation and scoring must use the same positions, or sampled and recomputed logprobs
    disagree (docs/design.md section 8).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


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
        adapter_base: str | Path | None = None,
    ):
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.critic = critic
        self.adapter_base = adapter_base
        """The base model folder when ``policy`` is a ``peft`` LoRA model, else None."""

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
        of its weights (:func:`ppo_core.modeling.lora.merged_for_sampling`: plain-model speed,
        the weights untouched afterwards). Sharded (FSDP) parameters must not be swapped:
        callers pass ``merge_adapter=False`` for them."""
        inner: Any = getattr(self.policy, "module", self.policy)
        if self.adapter_base is None or not merge_adapter:
            yield self.causal_lm
            return
        from ppo_core.modeling.lora import merged_for_sampling

        with merged_for_sampling(inner) as model:
            yield model

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int = 0
    ) -> tuple[Tensor, Tensor | None]:
        """With ``logits_to_keep=n > 0`` only the last ``n`` positions get logits (``[B, n, V]``);
        values always cover all ``L`` positions."""
        position_ids = position_ids_from_mask(attention_mask)
        out = self.causal_lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=self.has_critic and self.critic is None,
            use_cache=False,
            **logits_to_keep_kwargs(self.causal_lm, logits_to_keep),
        )
        if self.value_head is None:
            return out.logits, None
        if self.critic is None:
            hidden = out.hidden_states[-1]
        else:
            hidden = self.critic(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state
        # a new tensor, not a view: FSDP's backward hooks are lost on views of a root's output
        values = self.value_head(hidden.to(self.value_head.weight.dtype))[..., 0].clone()
        return out.logits, values

    def save(
        self,
        folder: str | Path,
        tokenizer=None,
        merged: bool = False,
        full_state: dict[str, Tensor] | None = None,
    ) -> None:
        """Write ``save_pretrained`` folders (safetensors) plus the value head, into ``folder``.

        A LoRA policy is written as its adapter (:func:`ppo_core.modeling.lora.save_adapter`),
        or with ``merged`` as a whole model with the adapter merged in; merging takes the
        adapter out of this model, so it is for the final save only. ``full_state``: this
        module's whole state dict when its own parameters are shards (FSDP), gathered by
        ``ppo_core.parallel``; the files are then written from it."""
        from safetensors.torch import save_file

        folder = Path(folder)
        if full_state is not None:
            self._save_gathered(folder, full_state, merged)
        elif self.adapter_base is None:
            self.policy.save_pretrained(folder, safe_serialization=True)
        elif merged:
            from ppo_core.modeling.lora import merged_model

            self.policy = merged_model(self.policy)
            self.adapter_base = None
            self.policy.save_pretrained(folder, safe_serialization=True)
        else:
            from ppo_core.modeling.lora import save_adapter

            save_adapter(self.policy, folder, self.adapter_base)
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
        from safetensors.torch import save_file

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
        if self.adapter_base is None:
            self.policy.save_pretrained(folder, state_dict=policy_state, safe_serialization=True)
        else:
            from ppo_core.modeling.lora import save_adapter

            adapter = folder / ".adapter" if merged else folder
            save_adapter(self.policy, adapter, self.adapter_base, state_dict=policy_state)
            if merged:  # the base read again, with the adapter just written merged in
                load_causal_lm(adapter, "policy").save_pretrained(folder, safe_serialization=True)
                shutil.rmtree(adapter)
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
    lora: LoraSettings | None = None,
    lora_base: str | Path | None = None,
) -> ActorCritic:
    """Policy (and critic) from a folder; the value head is loaded when the folder has one and
    initialised to zero otherwise (so the first values are 0, not noise). With ``critic="none"``
    there is no value head, and a folder's ``value_head.safetensors`` is not read.

    With ``lora`` the policy is the model in ``lora_base`` (``model.policy``) with a trainable
    LoRA adapter: the one in ``path`` when it is an adapter folder (a checkpoint, or a starting
    adapter), else a fresh one of that shape (:mod:`ppo_core.modeling.lora`)."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    folder = check_model_folder(path, "policy")
    adapter_base: Path | None = None
    policy: Any
    if lora is None:
        policy = load_causal_lm(folder, "policy", trust_remote_code, dtype)
    else:
        from ppo_core.modeling.lora import add_lora, load_trainable_adapter

        adapter_base = check_model_folder(lora_base or folder, "model.policy")
        policy = load_causal_lm(adapter_base, "model.policy", trust_remote_code, dtype)
        if (folder / ADAPTER_CONFIG).is_file():
            policy = load_trainable_adapter(policy, folder, adapter_base, "adapter").eval()
        else:
            policy = add_lora(policy, lora).eval()
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
        return ActorCritic(policy, None, None, adapter_base).eval()
    value_head = nn.Linear(hidden, 1, dtype=torch.float32)
    head_file = folder / VALUE_HEAD_FILE
    if head_file.is_file():
        state = load_file(str(head_file))
        if state["weight"].shape != value_head.weight.shape:
            raise ModelFolderError(
                f"{head_file} holds a value head of shape {tuple(state['weight'].shape)}, the "
                f"model needs {tuple(value_head.weight.shape)}"
            )
        value_head.load_state_dict(state)
    else:
        nn.init.zeros_(value_head.weight)
        nn.init.zeros_(value_head.bias)
    return ActorCritic(policy, value_head, critic_trunk, adapter_base).eval()


def _hidden_size(config) -> int:
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ModelFolderError(f"cannot tell the hidden size of a {type(config).__name__}")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper, a ``peft`` wrapper or both."""
    inner: Any = getattr(model, "module", model)
    if type(inner).__module__.startswith("peft."):
        inner = inner.get_base_model()
    return inner


def logits_to_keep_kwargs(model: nn.Module, logits_to_keep: int) -> dict[str, int]:
    """``{"logits_to_keep": n}`` where the model's ``forward`` takes it (most Hugging Face causal
    LMs since transformers 4.50), else nothing: every position then gets logits."""
    if logits_to_keep <= 0 or not _takes_logits_to_keep(type(unwrap_model(model))):
        return {}
    return {"logits_to_keep": logits_to_keep}


_TAKES_LOGITS_TO_KEEP: dict[type, bool] = {}


def _takes_logits_to_keep(kind: type) -> bool:
    if kind not in _TAKES_LOGITS_TO_KEEP:
        forward = getattr(kind, "forward")  # noqa: B009 - any nn.Module subclass
        _TAKES_LOGITS_TO_KEEP[kind] = "logits_to_keep" in inspect.signature(forward).parameters
    return _TAKES_LOGITS_TO_KEEP[kind]
