"""Hugging Face causal LMs and tokenizers from local folders, and what the passes over them
need: left-padded positions, ``logits_to_keep``, fused activations, activation checkpointing
(layer 2). A LoRA adapter folder loads through :func:`ppo_core.models.policy.load_causal_lm`.

Models come from local ``save_pretrained`` folders only; weights load from safetensors, and a
folder's own Python code runs only with ``trust_remote_code=True``. Transformers is imported
inside the functions that use it: importing it takes seconds, and the stages that never load a
model (prepare, validate, promote) import this module through their own.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ppo_core.files import first_line, printable
from ppo_core.models.folders import ModelFolderError, check_model_folder

__all__ = [
    "PadTokenWarning",
    "checkpoint_blocks",
    "from_pretrained_checked",
    "fuse_activations",
    "load_plain_causal_lm",
    "load_tokenizer",
    "logits_to_keep_kwargs",
    "position_ids_from_mask",
    "structure_only",
    "transformer_blocks",
    "unwrap_model",
]

_STRUCTURE_ONLY = contextvars.ContextVar("structure_only", default=False)


@contextlib.contextmanager
def structure_only() -> Iterator[None]:
    """Within it, models are built from their folder's config on the meta device, reading no
    weights: the ranks of a sharded run other than rank 0 build the structure this way and
    receive their shards from rank 0 (``ppo_core.parallel.strategies``)."""
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
    from safetensors import SafetensorError  # a header that lies about its tensors

    try:
        if _STRUCTURE_ONLY.get():
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(
                folder, trust_remote_code=kwargs.get("trust_remote_code", False)
            )
            with torch.device("meta"):
                return loader.from_config(config, **kwargs)
        return loader.from_pretrained(folder, use_safetensors=True, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
        raise ModelFolderError(
            f"cannot load {role} from {str(folder)!r}: {printable(first_line(exc))}"
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


def load_plain_causal_lm(
    path: str | Path,
    role: str = "policy",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """An ``AutoModelForCausalLM`` from a whole model folder (not an adapter), in eval mode
    (dropout off), its activations fused (:func:`fuse_activations`)."""
    from transformers import AutoModelForCausalLM

    folder = check_model_folder(path, role)
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
