"""Expert parallelism: a MoE layer's routed experts split over the mesh's "ep" ranks, tokens
sent to the rank that holds their expert and the outputs sent back (all-to-all).

The ep ranks are data-parallel ranks (parallel.mesh: dp = edp x ep): each reads its own samples,
runs attention, norms, router and shared experts as a dp rank does, and holds num_experts / ep
routed experts, rank r experts [r·E/ep, (r+1)·E/ep), as DTensors sharded on dim 0 over "ep" (so
a checkpoint holds whole (E, ·, ·) tensors and reshards to any ep). Dropless: every routed copy
is sent, so the split sizes of the all-to-all are uneven and exchanged first.

One MoE layer's forward on ep rank r:
1. the copies, already grouped by global expert (models.moe.dispatch), are counted per
   expert; an all-to-all of those counts tells every rank how many copies it will receive from
   each peer for each of its local experts;
2. all-to-all of the copies (peer p's block is the copies for p's experts);
3. the received blocks, ordered (source rank, local expert), are regrouped by local expert and
   each local expert runs on its block (a loop on CPU);
4. the outputs are put back in (source, expert) order and returned by the inverse all-to-all.
Backward is the same exchange reversed. The arithmetic of a token's copy is the same as
without ep, in the same order, so losses match a single process (tests/distributed/test_moe_ep.py).

Under parallel.reproducible (the experts have a gradient sink) step 3 runs each (source,
local expert) block on its own instead: the same GEMMs, on the same rows, as the source's
micro-batch runs in one process, so the outputs are the same bits; and each source's weight
gradients go to the sink separately, to be summed exactly (parallel.reproducible).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from models.moe.model import Experts, MoE


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, rows: torch.Tensor,
                out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits, group)  # type: ignore[attr-defined]
        return _exchange(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits, group = ctx.splits  # type: ignore[attr-defined]
        return _exchange(grad, in_splits, out_splits, group), None, None, None


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out


def regroup_order(counts: torch.Tensor) -> torch.Tensor:
    """counts (sources, experts) of rows laid out source-major → the row order that lays them
    out expert-major (expert 0's rows of every source in source order, then expert 1's, ...)."""
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    sources, experts = counts.shape
    pieces = [
        torch.arange(int(starts[s * experts + j]), int(starts[s * experts + j] + flat[s * experts + j]))
        for j in range(experts) for s in range(sources)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


class AllToAllExchange:
    """A MoE layer's `exchange` under expert parallelism over one process group."""

    def __init__(self, group: dist.ProcessGroup, size: int) -> None:
        self.group, self.size = group, size

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        local = counts.numel() // self.size
        # recv[s, j]: copies peer s sends for this rank's local expert j.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=self.group)
        recv = recv.view(self.size, local)
        send_splits = counts.view(self.size, local).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        received = _AllToAll.apply(rows, recv_splits, send_splits, self.group)
        if experts.gradient_sink is not None:
            # parallel.reproducible: each source's rows run as their own blocks, as that
            # micro-batch's rows run in one process, and their gradients stay apart.
            outputs = experts(received, recv.reshape(-1).tolist(), sources=self.size)
            return _AllToAll.apply(outputs, send_splits, recv_splits, self.group)
        order = regroup_order(recv).to(rows.device)
        outputs = experts(received[order], recv.sum(0).tolist())
        back = outputs[torch.argsort(order)]
        return _AllToAll.apply(back, send_splits, recv_splits, self.group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's routed experts over `ep_mesh` (dim 0) and swap in the
    all-to-all exchange; a no-op at ep 1. `model` is still on the meta device."""
    if ep_mesh.size() == 1:
        return
    exchange = AllToAllExchange(ep_mesh.get_group(), ep_mesh.size())
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        for name, param in list(module.experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.experts.register_parameter(name, nn.Parameter(sharded))
        module.exchange = exchange


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters (sharded over ep; reduced over edp, not dp)."""
    return [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
