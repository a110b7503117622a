"""How the models of a run are spread over data-parallel ranks (layer 3): ``parallel.strategy``.

- ``ddp`` (the default): every rank holds the whole policy, value head and reference; the
  update's gradients are averaged by ``DistributedDataParallel``.
- ``fsdp``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``). Every transformer block
  (the classes a Hugging Face model lists in ``_no_split_modules``) and then the whole
  actor-critic are sharded, so each rank keeps ``1/R`` of the parameters, gradients and optimizer
  state; the frozen reference is sharded the same way. Gradients are reduce-scattered and
  averaged over the ranks, exactly as DDP averages them, so the exact update of docs/design.md
  section 4 holds unchanged: each micro-batch backpropagates ``S * R / N``.

Both give the same numbers as one process holding the whole batch (fp32 round-off); the strategy
decides what each rank holds and how the whole model is gathered: for sampling (:meth:`gathered`,
all parameters at once instead of one all-gather per block per generated token) and for saving
the candidate (:meth:`full_state`, a collective every rank calls, after which rank 0 holds
ordinary tensors). Checkpoints of ``ddp`` hold whole tensors in the format of one process; those
of ``fsdp`` are sharded, every rank writing its own shards with ``torch.distributed.checkpoint``
(:mod:`ppo_core.checkpoints.sharded`). Either strategy resumes from either format, at
any world size. FSDP and DCP's state-dict helpers are imported in the methods that use them:
importing them takes about 1.7 s, which a run in one process never pays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from ppo_core.config import ConfigError
from ppo_core.models.causal_lm import ModuleT, structure_only, transformer_blocks
from ppo_core.parallel.process_group import DataParallel

__all__ = ["STRATEGIES", "ParallelStrategy", "ShardingError", "make_strategy"]

STRATEGIES = ("ddp", "fsdp")


class ShardingError(ConfigError):
    """A strategy cannot run as configured (``fsdp`` without ``torchrun``, a model without
    blocks to shard); the message names ``parallel.strategy``."""


class ParallelStrategy:
    """``ddp``: the whole model on every rank (DDP wraps it when there are several)."""

    name = "ddp"
    sharded = False
    """Whether each rank holds shards: checkpoints are then written by every rank (DCP)."""

    def __init__(
        self,
        parallel: DataParallel,
        device: torch.device,
        precision: str = "fp32",
        reference_offload: bool = False,
    ):
        self.parallel = parallel
        self.device = device
        self.precision = precision
        self.reference_offload = reference_offload

    def load(self, build: Callable[[], ModuleT]) -> ModuleT:
        """The model ``build`` loads, on this rank's device, ready for :meth:`wrap`."""
        return build().to(self.device)

    def wrap(self, actor_critic: nn.Module) -> nn.Module:
        """The module the update's passes run through."""
        if not self.parallel.active:
            return actor_critic

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(actor_critic, device_ids=device_ids)

    def wrap_reference(self, reference: nn.Module) -> nn.Module:
        return reference

    @contextlib.contextmanager
    def gathered(self, model: nn.Module) -> Iterator[None]:
        """Every parameter of ``model`` whole on this rank for the block (sampling)."""
        yield

    def full_state(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """``module``'s whole state as ordinary CPU tensors on rank 0 when its parameters are
        shards (every rank calls it); None when each rank holds them whole, so that the module
        is saved from its own parameters."""
        return None

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        """Load ``state``, the whole optimizer state of a checkpoint written by one process."""
        optimizer.load_state_dict(state)


class FullyShardedStrategy(ParallelStrategy):
    """``fsdp``: FSDP2 over every transformer block and the root (module docstring)."""

    name = "fsdp"
    sharded = True

    def load(self, build: Callable[[], ModuleT]) -> ModuleT:
        """Rank 0 loads the model into CPU memory; the other ranks build its structure on the
        meta device (:func:`~ppo_core.models.policy.structure_only`), reading no weights.
        :meth:`wrap` then shards it, moving one block at a time to the device, and sends each
        rank its shards from rank 0: no rank but 0 ever holds the whole model, and no device
        does."""
        if self.parallel.is_main:
            return build()
        with structure_only():
            return build()

    def wrap(self, actor_critic: nn.Module) -> nn.Module:
        self._check_gradient_averaging()
        self._shard(actor_critic)
        return actor_critic

    def _check_gradient_averaging(self) -> None:
        """Refuse to train when FSDP's gradient reduction does not average over the ranks.

        The exact update (docs/design.md section 4) relies on it averaging as DDP does; some
        torch and backend builds have summed instead, which would make every step ``R`` times
        too large without any error. Checked, not assumed: a probe sharded with this run's
        policies, on which rank ``r``'s loss is ``(r + 1) * sum(w)``, must get the gradient
        ``(R + 1) / 2`` on every weight (a sum gives ``R (R + 1) / 2``). One small collective.
        """
        from torch.distributed.fsdp import fully_shard

        ranks = self.parallel.world_size
        probe = nn.Linear(ranks, 1, bias=False, device=self.device)
        nn.init.zeros_(probe.weight)
        fully_shard(probe, **self._policies(offload=False))
        inputs = torch.full((1, ranks), float(self.parallel.rank + 1), device=self.device)
        probe(inputs).sum().backward()
        gradient = probe.weight.grad
        assert gradient is not None
        reduced = gradient.full_tensor() if hasattr(gradient, "full_tensor") else gradient
        kind = reduction_kind(reduced.float().cpu(), ranks)
        if kind != "average":
            raise ShardingError(
                f"parallel.strategy=fsdp: this torch build's FSDP gradient reduction gives the "
                f"{kind} over {ranks} ranks, not their average (probe gradient "
                f"{reduced.flatten()[0].item():g}, expected {(ranks + 1) / 2:g}); the update "
                "would not be exact. Use parallel.strategy=ddp, or another torch version"
            )

    def wrap_reference(self, reference: nn.Module) -> nn.Module:
        self._shard(reference, offload=self.reference_offload)
        return reference

    def _policies(self, offload: bool) -> dict[str, Any]:
        """``fully_shard``'s mixed-precision and offload policies for this run."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        policies: dict[str, Any] = {
            "offload_policy": (
                CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
                if offload
                else OffloadPolicy()
            )
        }
        if self.precision == "bf16":
            # bf16 gathers and compute (half the traffic of fp32), fp32 shards and gradient
            # reduction, so that the optimizer steps and the averaged sums stay fp32
            policies["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        return policies

    def _shard(self, model: nn.Module, offload: bool = False) -> None:
        """Shard ``model`` as :meth:`load` left it: whole on rank 0, on the meta device
        elsewhere."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )
        from torch.distributed.fsdp import fully_shard

        blocks = transformer_blocks(model)
        if not blocks:
            raise ShardingError(
                f"parallel.strategy=fsdp: found no transformer blocks to shard in a "
                f"{type(model).__name__} (its model names none in _no_split_modules)"
            )
        policies = self._policies(offload)
        # rank 0's whole tensors, kept until every rank has received its shards of them
        whole = model.state_dict() if self.parallel.is_main else {}
        for block in blocks:
            fully_shard(block, **policies)
        # The root reshards after its forward pass too (FSDP's default keeps a root gathered):
        # measured here, a root kept gathered went on computing with its parameters from
        # before the optimizer step, and the second step's gradient was wrong
        # (tests/parallel/test_distributed_training.py catches it).
        fully_shard(model, reshard_after_forward=True, **policies)
        if not self.parallel.is_main:
            model.to_empty(device=self.device)
        set_model_state_dict(
            model,
            whole,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        del whole
        # buffers are not sharded, and those outside the state dict (rotary frequencies) were
        # only allocated by to_empty on the other ranks
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        # FSDP sets the whole tree up at the first forward pass through its root; sampling calls
        # the causal LM inside it directly, which would set each block up as a root of its own
        device = self.device
        one_token = torch.ones(1, 1, dtype=torch.long, device=device)
        with torch.no_grad():
            model(input_ids=one_token, attention_mask=one_token)

    @contextlib.contextmanager
    def gathered(self, model: nn.Module) -> Iterator[None]:
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for module in sharded:
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()
        try:
            yield
        finally:
            for module in sharded:
                module.reshard()
                module.set_reshard_after_forward(True, recurse=False)

    def full_state(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        state = get_model_state_dict(
            module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:

        params = [p for group in optimizer.param_groups for p in group["params"]]

        def shard(value: Any, param: nn.Parameter) -> Any:
            if not isinstance(param, DTensor) or not torch.is_tensor(value):
                return value
            if value.shape != param.shape:  # a scalar such as AdamW's step
                return value
            # every rank read the same file: each keeps its own shard, nothing is sent
            return distribute_tensor(
                value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
            )

        optimizer.load_state_dict(
            {
                "state": {
                    index: {name: shard(value, params[int(index)]) for name, value in e.items()}
                    for index, e in state["state"].items()
                },
                "param_groups": state["param_groups"],
            }
        )


def reduction_kind(gradient: torch.Tensor, ranks: int) -> str:
    """What the FSDP probe's reduced gradient shows (:meth:`FullyShardedStrategy.wrap`):
    ``average``, ``sum``, or ``an unexpected value``; rank ``r`` contributed ``r + 1``."""
    contributions = torch.arange(1, ranks + 1, dtype=torch.float32)
    for kind, value in (("average", contributions.mean()), ("sum", contributions.sum())):
        if torch.allclose(gradient, torch.full_like(gradient, float(value))):
            return kind
    return "an unexpected value"


def make_strategy(
    name: str,
    parallel: DataParallel,
    device: torch.device,
    precision: str = "fp32",
    reference_offload: bool = False,
) -> ParallelStrategy:
    """The strategy called ``name`` (``parallel.strategy``) for this rank, with the run's
    ``precision`` and ``parallel.reference_offload``."""
    if name == "ddp":
        return ParallelStrategy(parallel, device, precision)
    if name == "fsdp":
        if not parallel.active:
            raise ShardingError(
                "parallel.strategy=fsdp needs 2 or more processes started by torchrun (e.g. "
                "torchrun --nproc_per_node 2 -m flows.cli train ...); one process has nothing "
                "to shard over (use parallel.strategy=ddp)"
            )
        return FullyShardedStrategy(parallel, device, precision, reference_offload)
    raise ShardingError(f"parallel.strategy={name!r}: choose one of {', '.join(STRATEGIES)}")
