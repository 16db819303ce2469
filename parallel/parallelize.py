"""Apply a layout to a single-device model, in one fixed order.

Order (docs/architecture.md, "Workers"): TP/SP -> EP -> CP -> PP split -> recompute ->
ZeRO/FSDP2 -> materialise.
Each technique lives in its own module; this file only sequences them.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.context_parallel import apply_context_parallel
from parallel.expert_parallel import apply_expert_parallel
from parallel.layout import Layout, check_supported
from parallel.mesh import data_mesh, expert_data_mesh, has_experts_dim
from parallel.mixed_precision import mixed_precision_policy
from parallel.pipeline import split_stages
from parallel.recompute import RecomputeMeter, apply_recompute
from parallel.tensor_parallel import apply_tensor_parallel
from parallel.zero import apply_zero

__all__ = ["mixed_precision_policy", "parallelize"]


def parallelize(
    model: nn.Module,
    layout: Layout,
    mesh: DeviceMesh,
    recompute_meter: RecomputeMeter | None = None,
) -> list[nn.Module]:
    """Shard `model` (still on the meta device) in place for `layout` on `mesh`.

    Returns the modules that run forward on this rank: `[model]`, or with pp > 1 this rank's
    pipeline stages (`model` then keeps only the union of their layers; see parallel.pipeline).
    """
    check_supported(layout)
    # 1. TP/SP: parameters become DTensors on the tp mesh (parallel.tensor_parallel).
    apply_tensor_parallel(model, layout, mesh["tp"])
    # 1b. EP: routed experts sharded over ep, tokens exchanged all-to-all
    #     (parallel.expert_parallel); their ZeRO group is then edp = dp / ep.
    expert_mesh = None
    if has_experts_dim(mesh):
        apply_expert_parallel(model, mesh["ep"])
        expert_mesh = expert_data_mesh(mesh)
    # 2. CP: ring attention over the cp dim and RoPE at global positions, on the shared blocks
    #    before the split so every stage holding a block sees it (parallel.context_parallel).
    apply_context_parallel(model, mesh["cp"])
    # 3. PP split.
    parts = split_stages(model, layout, mesh["pp"].get_local_rank()) if layout.pp > 1 else [model]
    # 4. Recompute, inside FSDP2's hooks so a recomputed block finds its parameters gathered.
    apply_recompute(model, layout.recompute, recompute_meter or RecomputeMeter())
    # 5. ZeRO: FSDP2 for ZeRO-2/3 (2-D with TP); ZeRO-1 lives in the optimizer (parallel.zero).
    #    Over dp x cp: cp ranks hold gradients of different tokens, summed like dp's.
    for part in parts:
        # One FSDP root per stage: the schedule reduces each stage's gradients once per step.
        apply_zero(part, layout, data_mesh(mesh), mixed_precision_policy(layout), expert_mesh)
    return parts
