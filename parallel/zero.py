"""ZeRO data parallelism with FSDP2 (the playbook's "Zero Redundancy Optimizer" section).

- ZeRO-3: parameters, gradients and optimizer state sharded; each block's parameters are
  all-gathered for its forward and again for its backward (`reshard_after_forward=True`).
- ZeRO-2: the same sharding at rest, but parameters stay gathered from forward to backward
  (`reshard_after_forward=False`): one all-gather per step instead of two, at the cost of
  holding a block's full parameters between its forward and backward.

Gradients are reduce-scattered as sums, not averages (gradient divide factor 1): the trainer
already divides every token loss by the global token count of the step, so averaging over
ranks would scale gradients by 1/dp and break dp-independence (ARCHITECTURE.md, promise (c)).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from parallel.layout import Layout


def apply_zero(
    model: nn.Module, layout: Layout, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy
) -> None:
    """Shard each transformer block, then the root (embedding, final norm, head)."""
    if layout.zero not in (2, 3):
        raise ValueError(f"apply_zero handles ZeRO-2 and ZeRO-3 (got zero={layout.zero})")
    reshard = layout.zero == 3
    layers = getattr(model, "layers", {})
    for block in layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    # The root's parameters are needed right at the start of backward: never reshard them.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling anyway.
            module.set_force_sum_reduction_for_comms(True)
