"""Allocating a parallelized model's parameters on its device, without DTensor's dispatch.

`nn.Module.to_empty` allocates each tensor with `torch.empty_like`, which on a DTensor goes
through DTensor's operator dispatch: a sharding propagation for every distinct (shape,
placement, mesh), cached per mesh. A mesh new to the process (the first generation, and every
generation after a recovery, whose caches trainer/teardown.py cleared with the old world) misses
that cache for every parameter shape, and each miss runs the operator on fake tensors: about a
millisecond apiece on this machine, several milliseconds of a recovery before the first step.
`materialize` allocates the local shard itself and wraps it as a DTensor with the same mesh,
placements, global shape and stride; nothing about the result differs from `to_empty`'s.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not isinstance(tensor, DTensor):
        return torch.empty_like(tensor, device=device)
    shard = tensor.to_local()
    local = torch.empty_strided(shard.shape, shard.stride(), dtype=shard.dtype, device=device)
    return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())


def materialize(model: nn.Module, device: torch.device) -> None:
    """Like `model.to_empty(device=device)`: every parameter and buffer allocated, values
    undefined (FSDP2's modules re-pad their shards as they do after `to_empty`)."""
    model._apply(lambda t: _empty_like(t, device))
