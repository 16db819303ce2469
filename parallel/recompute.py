"""Activation recomputation (the playbook's "Activation recomputation" section), measured.

- none: every block keeps its activations for backward.
- full: each transformer block keeps only its input; backward re-runs the block's forward
  (about one extra forward per step: ~1/3 more compute for ~1/L of the activations).
- selective: op-level selective checkpointing over each block. Matmul outputs (the expensive,
  small activations) are saved; everything else - the attention core (softmax(QK^T)V, whose
  activations grow with seq^2 unless flash attention is used), norms, RoPE, SwiGLU - is
  recomputed. This is the playbook's selective recomputation, with SDPA standing in for the
  attention core.

The checkpoint is applied by replacing the block's `forward` on the instance rather than by
wrapping the block in another module, so parameter names (and so DCP checkpoint keys and the
per-name weight init) are the same as in the plain model whatever the recompute mode.

Measurement: the wrapped forward times itself whenever it runs inside a backward pass (the
autograd engine has a current graph task only then), which is exactly the recomputation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
}


class RecomputeMeter:
    """Wall time spent re-running forward inside backward, since the last `reset`."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def reset(self) -> None:
        self.seconds = 0.0


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls)


def _timed(fn: Callable[..., Any], meter: RecomputeMeter) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:  # a plain forward, not a recomputation
            return fn(*args)
        start = time.perf_counter()
        try:  # early-stopped recomputation ends in an exception: still count its time
            return fn(*args)
        finally:
            meter.seconds += time.perf_counter() - start

    return run


def checkpoint_block(block: nn.Module, mode: str, meter: RecomputeMeter) -> None:
    """Make `block`'s forward checkpointed (full or selective), timing its recomputation."""
    inner = _timed(block.forward, meter)
    context_fn = _selective_contexts if mode == "selective" else noop_context_fn

    def forward(*args: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn)

    # An instance attribute: nn.Module.__call__ (and FSDP2's hooks around it) use it as is.
    block.forward = forward


def apply_recompute(model: nn.Module, mode: str, meter: RecomputeMeter) -> None:
    """Checkpoint every transformer block of `model` for `mode` (none/full/selective)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute mode must be none, full or selective (got {mode!r})")
    for block in model.layers.values():
        checkpoint_block(block, mode, meter)
