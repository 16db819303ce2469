"""Create an optimizer's state before a load, cheaply.

DCP's `get_state_dict` needs the optimizer's state to exist before it can be loaded into, and
creates a missing one by running a whole optimizer step on zero gradients. On a freshly formed
world (DTensor's sharding caches empty after `trainer.teardown.leave_world`) that step propagates
dozens of distinct DTensor ops and was most of a restore (docs/architecture.md, "Costs behind
the code"). The state a load overwrites
only needs the right keys, shapes, dtypes and placements, which `zeros_like` gives directly.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial


@torch.no_grad()
def prime_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter the state its optimizer's first step would create.

    Does nothing when the state exists. Optimizers it does not know are left to DCP's own
    zero-gradient step.
    """
    if optimizer.state:
        return
    init_state = getattr(optimizer, "init_state", None)
    if callable(init_state):  # parallel.zero.ShardedAdamW, trainer.shard_local_adamw
        init_state()
    elif type(optimizer) in (torch.optim.AdamW, torch.optim.Adam) and not any(
            g.get("fused") or g.get("capturable") or g.get("differentiable")
            for g in optimizer.param_groups):
        prime_adam_state(optimizer)


def prime_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Adam(W)'s state, zeroed, for every trainable parameter."""
    # As torch.optim.Adam(W)._init_group does on a first step (neither fused nor capturable).
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = {"step": torch.tensor(0.0, dtype=step_dtype),
                     "exp_avg": zeros_like(p), "exp_avg_sq": zeros_like(p)}
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = zeros_like(p)
            optimizer.state[p] = state


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    """`torch.zeros_like(t)`; for a DTensor, built from zeroed local shards, which skips
    DTensor's sharding propagation (uncached in a freshly formed world, a few ms per shape)."""
    if not isinstance(t, DTensor) or any(isinstance(p, Partial) for p in t.placements):
        return torch.zeros_like(t, memory_format=torch.preserve_format)
    local = torch.zeros_like(t._local_tensor, memory_format=torch.preserve_format)
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())
