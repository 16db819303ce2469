"""ZeRO data parallelism (the playbook's "Zero Redundancy Optimizer (ZeRO)" section).

Memory per device for Ψ parameters over N data-parallel ranks, with bf16 parameters and
gradients and fp32 Adam state (master weights, two moments: k = 12 bytes per parameter);
playbook, "ZeRO", memory table:

    vanilla DP  2Ψ + 2Ψ + 12Ψ          (params, grads, optimizer state, all replicated)
    ZeRO-1      2Ψ + 2Ψ + 12Ψ/N        optimizer state sharded
    ZeRO-2      2Ψ + 2Ψ/N + 12Ψ/N      + gradients sharded
    ZeRO-3      2Ψ/N + 2Ψ/N + 12Ψ/N    + parameters sharded

Collectives per step (Ψ elements each):

- ZeRO-1 (`ShardedAdamW`, ours): after the last micro-batch's backward, one reduce-scatter of
  the full (locally accumulated) gradients, so each rank holds the summed gradient of its slice;
  each rank runs AdamW on its slice only; one all-gather of the updated slices rebuilds the
  replicated parameters. Same volume as DP's all-reduce (= reduce-scatter + all-gather).
- ZeRO-2 (FSDP2, `reshard_after_forward=False`): parameters are all-gathered once per step and
  stay gathered from forward to backward; each micro-batch's gradients are reduce-scattered as
  soon as a block's backward is done, so full gradients never accumulate.
- ZeRO-3 (FSDP2, `reshard_after_forward=True`): a block's parameters are all-gathered for its
  forward, freed, and all-gathered again for its backward: 3Ψ per step instead of 2Ψ.

Gradients are reduced as sums, not averages (FSDP2 divide factor 1): the trainer already divides
every token loss by the global token count of the step, so averaging over ranks would scale
gradients by 1/dp and break dp-independence (docs/architecture.md, "The promise" (c)).

ZeRO-1 keeps its Adam moments as DTensors sharded over dp (and over tp like their parameter), on
the same global shapes as the parameters. `get_state_dict` therefore presents ZeRO-1 optimizer
state exactly like FSDP2's, and DCP reshards either into the other (dp2 ZeRO-1 -> dp4 ZeRO-3).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.optim.adam import adam

from models.moe.model import Experts
from parallel.layout import Layout


def apply_zero(
    model: nn.Module,
    layout: Layout,
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """ZeRO-2/3: shard each transformer block, then the root (embedding, final norm, head).

    `expert_mesh` (expert parallelism): the routed experts, already sharded over ep, are their
    own FSDP unit sharded over it (edp = dp / ep), before their block takes the rest over dp.
    ZeRO-1 changes no module (parameters stay replicated): its sharding lives in the optimizer,
    `ShardedAdamW`.
    """
    if layout.zero == 1:
        return
    reshard = layout.zero == 3
    layers = getattr(model, "layers", {})
    for block in layers.values():
        if expert_mesh is not None:
            for experts in [m for m in block.modules() if isinstance(m, Experts)]:
                fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard,
                            mp_policy=mp_policy)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    # The root's parameters are needed right at the start of backward: never reshard them.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling anyway.
            module.set_force_sum_reduction_for_comms(True)


class _Slot:
    """Where a parameter's ZeRO-1 slice lives: a dim of its local tensor split over dp."""

    def __init__(self, param: torch.Tensor, dp_mesh: DeviceMesh) -> None:
        self.dp_mesh = dp_mesh
        if isinstance(param, DTensor):
            # Split over dp along a dim TP leaves whole, so the state is a plain 2-D sharding
            # (Shard(d) on dp, the parameter's placement on tp) that DCP can address.
            tp_dims = {p.dim for p in param.placements if isinstance(p, Shard)}
            free = [d for d in range(param.ndim) if d not in tp_dims]
            if not free:
                raise ValueError(
                    f"ZeRO-1 needs a dim that tensor parallelism leaves whole (got {param.placements})"
                )
            self.dim = free[0]
            root = dp_mesh._get_root_mesh()
            names = (dp_mesh.mesh_dim_names[0], *param.device_mesh.mesh_dim_names)
            self.mesh = root[names]
            self.placements = (Shard(self.dim), *param.placements)
        else:
            self.dim = 0
            self.mesh = dp_mesh
            self.placements = (Shard(0),)
        self.rank = dp_mesh.get_local_rank()
        self.size = dp_mesh.size()

    def local_slice(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a parameter-shaped local tensor: a view, as DTensor's Shard splits."""
        chunks = torch.chunk(local, self.size, dim=self.dim)
        if self.rank < len(chunks):
            return chunks[self.rank]
        return local.narrow(self.dim, 0, 0)

    def as_state(self, local_slice: torch.Tensor, param: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local_slice,
            self.mesh,
            self.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    def reduce_scatter(self, grad_local: torch.Tensor) -> torch.Tensor:
        summed = DTensor.from_local(grad_local, self.dp_mesh, [Partial()], run_check=False)
        return summed.redistribute(self.dp_mesh, [Shard(self.dim)]).to_local()

    def all_gather(self, local_slice: torch.Tensor, local_shape: torch.Size) -> torch.Tensor:
        sharded = DTensor.from_local(
            local_slice.contiguous(),
            self.dp_mesh,
            [Shard(self.dim)],
            run_check=False,
            shape=local_shape,
            stride=_contiguous_stride(local_shape),
        )
        return sharded.redistribute(self.dp_mesh, [Replicate()]).to_local()


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedAdamW(torch.optim.Optimizer):
    """ZeRO-1 AdamW: replicated parameters and gradients, dp-sharded state and update.

    `expert_dp_mesh` (expert parallelism): parameters already sharded over the "ep" mesh dim
    (routed experts) are reduced and sharded over it (edp) instead of dp.

    `param_groups` hold the model's own parameters (so `get_state_dict` finds their names);
    `state[p]` holds `step` and the moments `exp_avg`/`exp_avg_sq` as DTensors on p's global
    shape, sharded over dp. The trainer may call `reduce_gradients()` before `step()` to clip the
    summed gradient slices; `step()` reduces them itself otherwise.
    """

    def __init__(
        self,
        params: Iterable[Any],
        dp_mesh: DeviceMesh,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        expert_dp_mesh: DeviceMesh | None = None,
    ) -> None:
        # AdamW's own hyper-parameter set (amsgrad, maximize, ... at their defaults, which this
        # update implements), so param_groups in a checkpoint load into either optimizer.
        defaults = torch.optim.AdamW(
            [nn.Parameter(torch.zeros(1))], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        ).defaults
        super().__init__(params, defaults)
        self.dp_mesh = dp_mesh
        self.expert_dp_mesh = expert_dp_mesh
        self._slots: dict[torch.Tensor, _Slot] = {}
        self._grad_slices: dict[torch.Tensor, torch.Tensor] = {}

    def _slot(self, p: torch.Tensor) -> _Slot:
        if p not in self._slots:
            mesh = self.dp_mesh
            if (self.expert_dp_mesh is not None and isinstance(p, DTensor)
                    and "ep" in (p.device_mesh.mesh_dim_names or ())):
                mesh = self.expert_dp_mesh
            self._slots[p] = _Slot(p, mesh)
        return self._slots[p]

    def slice_dim(self, p: torch.Tensor) -> int:
        """The dim of p's local tensor that its slices split (parallel.reproducible)."""
        return self._slot(p).dim

    @torch.no_grad()
    def reduce_gradients(self) -> list[DTensor]:
        """Reduce-scatter every gradient over dp; returns the summed slices (as DTensors).

        The full gradients are dropped: from here on only this rank's slice is needed.
        """
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if isinstance(grad, DTensor) and grad.placements != p.placements:
                    # e.g. a sequence-parallel norm weight: Partial over tp until reduced here.
                    grad = grad.redistribute(p.device_mesh, p.placements)
                slot = self._slot(p)
                piece = slot.reduce_scatter(_local(grad).float())
                self._grad_slices[p] = piece
                p.grad = None
                out.append(slot.as_state(piece, p))
        return out

    def set_gradient_slices(self, slices: dict[torch.Tensor, torch.Tensor]) -> list[DTensor]:
        """Use gradient slices reduced elsewhere (parallel.reproducible's exact reduction),
        each this rank's `local_slice` of its parameter; returns them as DTensors."""
        out = []
        for p, piece in slices.items():
            slot = self._slot(p)
            expected = slot.local_slice(_local(p)).shape
            if piece.shape != expected:
                raise ValueError(f"gradient slice of shape {tuple(piece.shape)}, expected {tuple(expected)}")
            self._grad_slices[p] = piece
            out.append(slot.as_state(piece, p))
        return out

    def _state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """p's state, created (zeros, as AdamW's first step creates it) when it has none."""
        state = self.state[p]
        if not state:
            slot = self._slot(p)
            state["step"] = torch.zeros((), dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                zeros = torch.zeros_like(slot.local_slice(_local(p)), dtype=torch.float32)
                state[key] = slot.as_state(zeros, p)
        return state

    @torch.no_grad()
    def init_state(self) -> None:
        """The state of every trainable parameter, as before a first step (a load fills it)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._state_of(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Also the reduced slices: a step skipped for a non-finite gradient must not leave
        # them for the next step to apply.
        self._grad_slices.clear()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("ShardedAdamW does not support a closure")
        if not self._grad_slices:
            self.reduce_gradients()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = self._grad_slices.pop(p, None)
                if grad is None:
                    continue
                slot = self._slot(p)
                state = self._state_of(p)
                local = _local(p)
                # The update runs on the slice in fp32 (the master copy, when p is fp32).
                piece = slot.local_slice(local)
                master = piece if piece.dtype == torch.float32 else piece.float()
                adam(
                    [master],
                    [grad],
                    [_local(state["exp_avg"])],
                    [_local(state["exp_avg_sq"])],
                    [],
                    [state["step"]],
                    foreach=False,
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                local.copy_(slot.all_gather(master.to(local.dtype), local.shape))
        self._grad_slices.clear()
