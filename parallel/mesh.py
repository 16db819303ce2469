"""The device mesh of a generation: dims (pp, dp, cp, tp), tp innermost.

Global ranks are node-major and tp is the fastest-varying dim, so a TP group is made of
consecutive ranks and never spans nodes as long as tp divides the devices per node.

Gradients and the step's loss and token sums reduce over dp x cp: the cp ranks of a replica
read the same samples, each a share of every sequence (parallel.context_parallel), so for ZeRO
and FSDP2 they are data-parallel ranks like the dp ones. With cp > 1 that group is a flattened
"dp_cp" dim of the mesh; `data_mesh` returns it (the plain dp dim at cp 1).

Expert parallelism (parallel.expert_parallel) splits dp in two, dp = edp x ep with ep inner:
the mesh is then built on (pp, edp, cp, ep, tp) and "dp" is the flattened (edp, ep), so dp
ranks, the data split and everything reducing over dp are as without ep. ep sits inside cp
so that the experts' ZeRO group, the flattened (edp, cp) "edp_cp", comes before "ep" in the
mesh: FSDP2 and ZeRO-1 slice the root mesh as (edp_cp, ep), which DeviceMesh only allows in
ascending dim order. At cp 1 the ranks are placed exactly as with (pp, edp, ep, cp, tp).
Routed experts are sharded over "ep" and their gradients reduced over the ranks holding the
same experts, edp x cp (`expert_data_mesh`): the cp ranks of a replica hold other tokens of
the same sequences, whose gradients add up like other samples'.

Every sub-group gets the job's process-group timeout. `init_device_mesh` otherwise creates
them with torch's default (30 minutes), whatever the default group's timeout: a rank that
vanished mid-collective would then hold its TP or DP peers for half an hour. A dim that spans
the whole world is the default group itself when that has the job's timeout already (as every
generation's has): one group fewer to make at a generation's start.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.layout import Layout

MESH_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "edp", "cp", "ep", "tp")
DATA_DIM = "dp_cp"
EXPERT_DATA_DIM = "edp_cp"


def _timeout_options(device_type: str, timeout: timedelta) -> C10dBackend.Options:
    """Backend options that carry only a timeout, for `init_device_mesh`'s backend_override.

    DeviceMesh passes an option's `_timeout` to `new_group` (so the group's creation and all
    its collectives are bounded by it); the option's type must suit the backend of the device.
    """
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def _world_timeout(device_type: str) -> timedelta | None:
    """The default group's timeout on `device_type`'s backend (None: not known)."""
    try:
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(torch.device(device_type)).options._timeout
    except (RuntimeError, AttributeError, ValueError):
        return None


def build_mesh(layout: Layout, device_type: str, timeout: timedelta) -> DeviceMesh:
    if layout.ep > 1:
        dims = EXPERT_MESH_DIMS
        shape: tuple[int, ...] = (layout.pp, layout.dp // layout.ep, layout.cp, layout.ep,
                                  layout.tp)
    else:
        dims, shape = MESH_DIMS, (layout.pp, layout.dp, layout.cp, layout.tp)
    mesh = init_device_mesh(
        device_type,
        shape,
        mesh_dim_names=dims,
        # A dim over the whole world is the default group when that has the same timeout:
        # one process group fewer to make at every generation's start.
        backend_override={dim: _timeout_options(device_type, timeout)
                          for dim, n in zip(dims, shape, strict=True)
                          if n != dist.get_world_size() or _world_timeout(device_type) != timeout},
    )
    if layout.ep > 1:
        mesh["edp", "ep"]._flatten("dp", _timeout_options(device_type, timeout))
    if layout.cp > 1:
        # Created here, once, with the timeout; `data_mesh` and `expert_data_mesh` find them
        # again by name.
        _data_dims(mesh)._flatten(DATA_DIM, _timeout_options(device_type, timeout))
        if layout.ep > 1:
            mesh["edp", "cp"]._flatten(EXPERT_DATA_DIM, _timeout_options(device_type, timeout))
    return mesh


def _data_dims(mesh: DeviceMesh) -> DeviceMesh:
    """The (not yet flattened) dims of dp x cp: (dp, cp), or (edp, cp, ep) under ep."""
    return mesh["edp", "cp", "ep"] if has_experts_dim(mesh) else mesh["dp", "cp"]


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that gradients and loss sums reduce over: dp x cp (1-D)."""
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    # Flattening again under the same name returns the mesh build_mesh made.
    return _data_dims(mesh)._flatten(DATA_DIM)


def expert_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks a routed expert's gradient reduces over, those holding the same experts:
    dp / ep ("edp"), times cp when cp > 1 ("edp_cp")."""
    if mesh["cp"].size() == 1:
        return mesh["edp"]
    return mesh["edp", "cp"]._flatten(EXPERT_DATA_DIM)


def has_experts_dim(mesh: DeviceMesh) -> bool:
    return "ep" in (mesh.mesh_dim_names or ())
