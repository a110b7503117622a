"""LoRA adapters with ``peft`` (layer 2): adding, loading and saving them, the KL reference that
shares the policy's weights, and adapter folders as models.

Hu et al. (2021), "LoRA: Low-Rank Adaptation of Large Language Models": each targeted linear
layer computes ``W x + (alpha / r) B A x`` with ``W`` frozen and only ``A`` (``r x in``) and ``B``
(``out x r``, initialised to zero) trained, so a fresh adapter starts as the base model exactly.

An adapter folder written here records the base it applies to, with that base's fingerprint
(:mod:`ppo_core.models.adapter_folders`), so that an adapter is never applied to another base.

:class:`LoraWeights` is the adapter as the policy's trained weights
(:class:`ppo_core.models.weights.PolicyWeights`). ``peft`` is imported inside the functions
that use it: importing it takes about 3 s, which a run without LoRA never pays.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from ppo_core.files import first_line
from ppo_core.models.adapter_folders import (
    ADAPTER_BASE_FILE,
    ADAPTER_CONFIG_FILE,
    AdapterError,
    adapter_base_folder,
    base_fingerprint,
    check_adapter_folder,
    check_base_matches,
    is_adapter_folder,
    point_adapter_at,
    recorded_fingerprint,
)
from ppo_core.models.causal_lm import load_plain_causal_lm, unwrap_model
from ppo_core.models.folders import check_model_folder
from ppo_core.models.weights import PolicyWeights

__all__ = [
    "ADAPTER_BASE_FILE",
    "ADAPTER_CONFIG_FILE",
    "AdapterError",
    "AdapterReference",
    "LoraSettings",
    "LoraWeights",
    "adapter_base_folder",
    "adapter_dropout",
    "add_lora",
    "add_reference_adapter",
    "base_fingerprint",
    "is_adapter_folder",
    "load_adapter_model",
    "load_trainable_adapter",
    "merged_for_sampling",
    "merged_model",
    "save_adapter",
]

POLICY_ADAPTER = "default"
"""The trained adapter's name in the ``peft`` model (``peft``'s own default)."""
REFERENCE_ADAPTER = "reference"
"""The frozen copy of a starting adapter that serves as the KL reference."""


@dataclass(frozen=True)
class LoraSettings:
    """A fresh adapter's shape (``model.lora.*``)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)


def add_lora(model: nn.Module, settings: LoraSettings) -> Any:
    """``model`` (a causal LM) wrapped by ``peft`` with a fresh trainable adapter; every base
    weight is frozen. A target module the model does not have is an :class:`AdapterError` that
    names ``model.lora.target_modules`` and the model's linear layers."""
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = (
        "all-linear"
        if list(settings.target_modules) == ["all-linear"]
        else list(settings.target_modules)
    )
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=cast(Any, settings.alpha),  # peft annotates int; the scale is alpha / r
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    names = [name for name, _ in model.named_modules()]
    missing = [
        target
        for target in targets
        if targets != "all-linear"
        and not any(name == target or name.endswith(f".{target}") for name in names)
    ]
    if missing:
        raise AdapterError(
            f"model.lora.target_modules={list(settings.target_modules)}: the model has no "
            f"module named {', '.join(map(repr, missing))}; its linear layers end in: "
            f"{', '.join(_linear_names(model))}"
        )
    try:
        with quiet_peft():
            return get_peft_model(model, config)
    except ValueError as exc:
        raise AdapterError(
            f"model.lora.target_modules={list(settings.target_modules)}: {first_line(exc)}; "
            f"the model's linear layers end in: {', '.join(_linear_names(model))}"
        ) from None


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Without the warnings peft gives that say nothing to the user: GPT-2's Conv1D layers get
    ``fan_in_fan_out`` (right), and transformers' deprecation of the name peft reads
    (``is_gradient_checkpointing``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield


def _linear_names(model: nn.Module) -> list[str]:
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
    }
    return sorted(names)


def load_trainable_adapter(
    model: nn.Module, folder: str | Path, base: str | Path, role: str
) -> Any:
    """``model`` (the base, loaded from ``base``) with the adapter in ``folder`` as the trained
    adapter."""
    from peft import PeftModel

    folder = check_adapter_folder(folder, role)
    check_base_matches(folder, base, recorded_fingerprint(folder))
    try:
        with quiet_peft():
            return PeftModel.from_pretrained(
                model, folder, adapter_name=POLICY_ADAPTER, is_trainable=True
            )
    except (ValueError, RuntimeError, KeyError, OSError) as exc:
        raise AdapterError(
            f"{role} {str(folder)!r} does not fit model.policy {str(base)!r}: {first_line(exc)}"
        ) from None


def add_reference_adapter(peft_model: Any, folder: str | Path, base: str | Path) -> None:
    """Load the adapter in ``folder`` beside the trained one, frozen, as the KL reference
    (:class:`AdapterReference`); the trained adapter stays the active one."""
    folder = check_adapter_folder(folder, "model.lora.adapter")
    check_base_matches(folder, base, recorded_fingerprint(folder))
    try:
        with quiet_peft():
            peft_model.load_adapter(folder, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
    except (ValueError, RuntimeError, KeyError, OSError) as exc:
        raise AdapterError(
            f"model.lora.adapter {str(folder)!r} does not fit model.policy {str(base)!r}: "
            f"{first_line(exc)}"
        ) from None
    peft_model.set_adapter(POLICY_ADAPTER)


def load_adapter_model(
    folder: str | Path,
    role: str = "policy",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """An adapter folder written by this project as a plain causal LM for sampling and scoring:
    its recorded base with the adapter merged in."""
    from peft import PeftModel

    folder = check_adapter_folder(folder, role)
    base_folder = adapter_base_folder(folder)
    base = load_plain_causal_lm(base_folder, role, trust_remote_code, dtype)
    try:
        with quiet_peft():
            model = PeftModel.from_pretrained(base, folder, adapter_name=POLICY_ADAPTER)
    except (ValueError, RuntimeError, KeyError, OSError) as exc:
        raise AdapterError(
            f"{role} adapter {str(folder)!r} does not fit its base {str(base_folder)!r}: "
            f"{first_line(exc)}"
        ) from None
    return model.merge_and_unload().eval()


def save_adapter(
    peft_model: Any,
    folder: str | Path,
    base: str | Path,
    state_dict: dict[str, Tensor] | None = None,
) -> None:
    """Write the trained adapter to ``folder`` with ``adapter_base.json`` naming ``base``;
    from ``state_dict`` (the peft model's whole state, gathered from shards) when given."""
    folder = Path(folder)
    peft_model.save_pretrained(
        folder,
        selected_adapters=[POLICY_ADAPTER],
        safe_serialization=True,
        **({"state_dict": state_dict} if state_dict is not None else {}),
    )
    point_adapter_at(folder, base, base_fingerprint(base))
    # peft's model card names the base by the absolute path it was loaded from: a shared file
    # must not record the user's folders, and adapter_base.json says what the card would
    (folder / "README.md").unlink(missing_ok=True)


def merged_model(peft_model: Any) -> Any:
    """The causal LM with the trained adapter merged into its weights (in place: the adapter
    is gone afterwards, so this is for the final save only)."""
    for name in list(peft_model.peft_config):
        if name != POLICY_ADAPTER:
            peft_model.delete_adapter(name)
    return peft_model.merge_and_unload()


@contextlib.contextmanager
def merged_for_sampling(peft_model: Any) -> Iterator[nn.Module]:
    """The causal LM with the trained adapter merged into its weights, for sampling only: each
    LoRA layer is replaced by its plain base layer, computing with ``W + (alpha / r) B A`` in one
    matrix, so that no adapter code runs and the model is as fast as one without an adapter; on
    leaving, every LoRA layer is back in its place with its own weight tensor, bit for bit.

    ``peft``'s ``merge_adapter``/``unmerge_adapter`` would add and subtract the update in place,
    which rounds ``W`` a little differently at every iteration, and the frozen base is also the
    KL reference; here the merged weights are new tensors (one copy of the adapted weights for
    the duration of the block) and ``W`` is never written. Scoring, the reference and the update
    run outside the block, on the unmerged model, so the log-probabilities that enter the update
    are exactly what they were. Yields the model unchanged (adapter layers on) when an adapter
    is not plain LoRA on linear layers (DoRA, embeddings, convolutions), which this does not
    merge."""
    from peft.tuners.lora import Linear, LoraLayer

    named = [(n, m) for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)]
    plain = all(
        isinstance(m, Linear)
        and not m.use_dora.get(POLICY_ADAPTER, False)
        and not getattr(m, "lora_bias", {}).get(POLICY_ADAPTER, False)
        and m.active_adapters == [POLICY_ADAPTER]
        for _, m in named
    )
    if not named or not plain:
        yield peft_model.get_base_model()
        return
    modules = dict(peft_model.named_modules())
    swapped: list[tuple[nn.Module, str, Any, nn.Module, Any]] = []
    try:
        with torch.no_grad():
            for name, layer in named:
                parent_name, _, attribute = name.rpartition(".")
                parent, base = modules[parent_name], layer.get_base_layer()
                weight: Any = base.weight
                swapped.append((parent, attribute, layer, base, weight))
                if POLICY_ADAPTER in layer.lora_A:
                    base._parameters["weight"] = nn.Parameter(
                        _merged_weight(layer, weight), requires_grad=False
                    )
                # the plain layer in the LoRA layer's place: no adapter code runs while sampling
                setattr(parent, attribute, base)
        yield peft_model.get_base_model()
    finally:
        for parent, attribute, layer, base, weight in reversed(swapped):
            base._parameters["weight"] = weight
            setattr(parent, attribute, layer)


def _merged_weight(layer: Any, weight: Tensor) -> Tensor:
    """``W + (alpha / r) B A`` of a ``peft`` LoRA linear layer as a new tensor, in one ``addmm``
    (``W`` stored transposed, ``fan_in_fan_out``, for GPT-2's Conv1D)."""
    lora_a = layer.lora_A[POLICY_ADAPTER].weight.to(weight.dtype)  # [r, in]
    lora_b = layer.lora_B[POLICY_ADAPTER].weight.to(weight.dtype)  # [out, r]
    scaling = layer.scaling[POLICY_ADAPTER]
    if layer.fan_in_fan_out:
        return torch.addmm(weight, lora_a.t(), lora_b.t(), alpha=scaling)
    return torch.addmm(weight, lora_b, lora_a, alpha=scaling)


class AdapterReference(nn.Module):
    """The frozen KL reference of a LoRA policy, sharing its weights: the policy's causal LM with
    the trained adapter switched off, or with the frozen :data:`REFERENCE_ADAPTER` (a copy of
    the starting adapter) in its place. Called like the causal LM; gradient-free use only."""

    _peft_model: Any

    def __init__(self, peft_model: Any, reference_adapter: bool):
        super().__init__()
        # not registered as a submodule: the policy's weights belong to the actor-critic
        object.__setattr__(self, "_peft_model", peft_model)
        self.reference_adapter = reference_adapter

    @property
    def module(self) -> nn.Module:
        """The causal LM itself (what the scoring code inspects for ``logits_to_keep``)."""
        return self._peft_model.get_base_model()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        model = self._peft_model
        if not self.reference_adapter:
            with model.disable_adapter():
                yield
            return
        model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
        try:
            yield
        finally:
            model.set_adapter(POLICY_ADAPTER)  # trainable again (set_adapter sets requires_grad)

    def forward(self, **kwargs: Any) -> Any:
        with self.active():
            return self.module(**kwargs)


@contextlib.contextmanager
def adapter_dropout(model: nn.Module, enabled: bool) -> Iterator[None]:
    """The adapters' dropout modules in training mode for the block, the rest of the model as it
    is (eval mode: PPO keeps the base model's dropout off, docs/design.md section 8)."""
    dropouts: Sequence[nn.Module] = (
        [m for name, m in model.named_modules() if ".lora_dropout." in f".{name}."]
        if enabled
        else []
    )
    for module in dropouts:
        module.train()
    try:
        yield
    finally:
        for module in dropouts:
            module.eval()


class LoraWeights(PolicyWeights):
    """A LoRA adapter on the frozen base ``base`` (``model.policy``) as the policy's trained
    weights: a fresh one of the shape ``settings``, or the adapter of a start or checkpoint
    folder; ``start_adapter`` (``model.lora.adapter``), when given, is the frozen KL reference
    beside it."""

    model_role = "model.policy"

    def __init__(
        self,
        settings: LoraSettings,
        base: str | Path,
        start_adapter: str | Path | None = None,
    ):
        self.settings = settings
        self.base = base
        self.start_adapter = start_adapter

    def model_folder(self, folder: Path) -> Path:
        self.adapter_base = check_model_folder(self.base, "model.policy")
        return self.adapter_base

    def attach(self, model: nn.Module, folder: Path) -> nn.Module:
        assert self.adapter_base is not None, "model_folder() names the base first"
        if is_adapter_folder(folder):
            return load_trainable_adapter(model, folder, self.adapter_base, "adapter").eval()
        return add_lora(model, self.settings).eval()

    @contextlib.contextmanager
    def sampling_model(self, policy: nn.Module, merge: bool) -> Iterator[nn.Module]:
        """With ``merge``, the adapter merged into copies of the weights
        (:func:`merged_for_sampling`: plain-model speed, the weights untouched afterwards)."""
        if not merge:
            yield unwrap_model(policy)
            return
        with merged_for_sampling(getattr(policy, "module", policy)) as model:
            yield model

    def shared_reference(self, policy: nn.Module) -> nn.Module | None:
        """The policy with the trained adapter off, or with a frozen copy of ``start_adapter``
        in its place (:class:`AdapterReference`)."""
        if self.start_adapter is not None:
            add_reference_adapter(policy, self.start_adapter, self.base)
        return AdapterReference(policy, self.start_adapter is not None)

    def save(
        self,
        policy: nn.Module,
        folder: Path,
        merged: bool,
        state_dict: dict[str, Tensor] | None = None,
    ) -> nn.Module:
        """The adapter (:func:`save_adapter`), or with ``merged`` a whole model with the adapter
        merged in: in place, which takes the adapter out of ``policy`` (for the final save
        only), or from ``state_dict`` through an adapter folder read back on its base."""
        assert self.adapter_base is not None, "the policy was built with model_folder()"
        if not merged:
            save_adapter(policy, folder, self.adapter_base, state_dict=state_dict)
            return policy
        if state_dict is None:
            whole = merged_model(policy)
            whole.save_pretrained(folder, safe_serialization=True)
            return whole
        adapter = folder / ".adapter"
        save_adapter(policy, adapter, self.adapter_base, state_dict=state_dict)
        reloaded: Any = load_adapter_model(adapter)
        reloaded.save_pretrained(folder, safe_serialization=True)
        shutil.rmtree(adapter)
        return policy

    def updating(self, policy: nn.Module) -> contextlib.AbstractContextManager:
        """The adapters' dropout on (:func:`adapter_dropout`) when ``model.lora.dropout`` > 0."""
        return adapter_dropout(policy, self.settings.dropout > 0)
