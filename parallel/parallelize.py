"""Apply a layout to a single-device model, in one fixed order.

Order (ARCHITECTURE.md, Workers): TP/SP -> PP split -> recompute -> ZeRO/FSDP2 -> materialise.
Each technique lives in its own module; this file only sequences them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from parallel.layout import Layout, check_supported
from parallel.zero import apply_zero


def mixed_precision_policy(layout: Layout) -> MixedPrecisionPolicy:
    if layout.mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def parallelize(model: nn.Module, layout: Layout, mesh: DeviceMesh) -> nn.Module:
    """Shard `model` (still on the meta device) in place for `layout` on `mesh`."""
    check_supported(layout)
    apply_zero(model, layout, mesh["dp"], mixed_precision_policy(layout))
    return model
