"""bf16 mixed precision with fp32 master weights (the playbook's "Mixed precision training").

Parameters at rest (the master weights the optimizer updates), gradients as reduced and the
optimizer state stay fp32; forward and backward compute in bf16.

- ZeRO-2/3 (FSDP2): `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`. FSDP2 all-gathers
  bf16 copies of the fp32 shards for compute, and casts each gradient to fp32 before the
  reduce-scatter, so reduction and accumulation are fp32.
- ZeRO-1 (replicated parameters, no FSDP2): `torch.autocast(bf16)` around forward and backward.
  Matmuls and attention run in bf16 on bf16 casts of the fp32 parameters; weight gradients come
  back fp32 through the casts, so the reduce-scatter and the update are fp32. Unlike a stored
  bf16 parameter copy (the playbook's 2Ψ), autocast re-casts each weight when it is used: the
  same arithmetic, with fp32 rather than bf16 parameter memory.

Norms and the loss upcast to fp32 internally (ops.norm, ops.loss) whatever the compute dtype.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from parallel.layout import Layout


def mixed_precision_policy(layout: Layout) -> MixedPrecisionPolicy:
    """FSDP2's policy for ZeRO-2/3."""
    if layout.mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def compute_context(
    layout: Layout, device: torch.device
) -> contextlib.AbstractContextManager[None]:
    """Around forward and backward: autocast where FSDP2 does not cast (ZeRO-1)."""
    if layout.mixed_precision == "bf16" and layout.zero == 1:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
