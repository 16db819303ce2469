"""The whole gradient's norm and clipping, computed on local shards.

`torch.nn.utils.get_total_norm` on DTensor gradients dispatches every norm, stack and scale
through DTensor. Each distinct op and layout costs a sharding propagation the first time a mesh
sees it, and those caches start empty in every new world: a large part of the first step after
each recovery (docs/architecture.md, "Costs behind the code"). Here each rank sums the squares of its local
shards and all-reduces the sums over the mesh dimensions each gradient is sharded on, once per
distinct (mesh, sharded dimensions): the same norm, up to float rounding, with no DTensor op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

# Layouts whose local shards are disjoint pieces of the tensor (FSDP2 over a tensor-parallel
# dimension shards the same tensor dim again: _StridedShard).
_SHARDED = (Shard, _StridedShard)


def squared_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Sum of squares of every element of `grads` across all ranks that shard them, as a 0-d
    fp32 tensor; None when a gradient has a placement other than Replicate and a shard (a
    Partial one: a pending reduction), which only DTensor can resolve. Collective: every rank
    of the meshes must call it with gradients of the same layouts in the same order."""
    sums: dict[tuple[object, tuple[int, ...]], list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            if not all(isinstance(p, (Replicate, *_SHARDED)) for p in g.placements):
                return None
            dims = tuple(i for i, p in enumerate(g.placements) if isinstance(p, _SHARDED))
            key: tuple[object, tuple[int, ...]] = (g.device_mesh, dims)
            local = g.to_local()
        else:
            key, local = (None, ()), g
        sums.setdefault(key, []).append(local.detach().float().square().sum())
    total: torch.Tensor | None = None
    for (mesh, dims), parts in sums.items():
        part = torch.stack(parts).sum()
        for dim in dims:
            assert mesh is not None
            dist.all_reduce(part, group=mesh.get_group(dim))  # type: ignore[attr-defined]
        total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=torch.float32)


def scale_(grads: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient by the 0-d tensor `coef`, in place, shard by shard."""
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
