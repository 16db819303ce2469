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

Every sub-group gets the job's process-group timeout (torch's default is 30 minutes, whatever
the default group's: a rank that vanished mid-collective would then hold its TP or DP peers for
half an hour). A dim that spans the whole world is the default group itself when that has the
job's timeout already (as every generation's has).

A rank makes only the groups it is in, one per dim, with its members alone
(`new_group(..., use_local_synchronization=True)`), and the mesh is assembled from them
(`DeviceMesh.from_group`). `init_device_mesh` on a backend without comm splitting (gloo, and
nccl without a bound device) calls `new_group` on every rank for every group of every dim,
members or not: a dim of size 1 (pp, cp, tp of a data-parallel job) is `world` groups of one,
so a generation's start grew with the world (24 calls per rank at 8 ranks; 3,072 at 1,024).
Dims of size 1 share one group of this rank alone. A member computes a group's name from its
ranks and the number of groups it made before; every rank makes the same number before each
dim, since `build_mesh` is the first thing a world does after its default group. The
flattened dims (dp x cp, and dp under ep) are torch's `_flatten`: one call per group of the
flattened dim, whose groups are few (world / (dp x cp)).
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import DeviceMesh

from parallel.layout import Layout

MESH_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "edp", "cp", "ep", "tp")
DATA_DIM = "dp_cp"
EXPERT_DATA_DIM = "edp_cp"


def _timeout_options(device_type: str, timeout: timedelta) -> C10dBackend.Options:
    """Backend options that carry only a timeout, for `DeviceMesh._flatten`'s backend_override.

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


def _line(shape: tuple[int, ...], rank: int, dim: int) -> list[int]:
    """The global ranks that share every coordinate but `dim`'s with `rank` (ranks laid out
    row-major over `shape`, the last dim fastest)."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    start = rank - (rank // strides[dim]) % shape[dim] * strides[dim]
    return [start + i * strides[dim] for i in range(shape[dim])]


def _dim_groups(shape: tuple[int, ...], device_type: str,
                timeout: timedelta) -> list[dist.ProcessGroup]:
    """Per dim, the group of this rank's line along it, made by its members only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    groups = []
    for dim in range(len(shape)):
        members = tuple(_line(shape, rank, dim))
        if members not in made:  # the dims of size 1: one group of this rank alone
            if len(members) == world and _world_timeout(device_type) == timeout:
                made[members] = dist.group.WORLD
            else:
                made[members] = dist.new_group(list(members), timeout=timeout,
                                               use_local_synchronization=True,
                                               group_desc=f"mesh_dim_{dim}")
        groups.append(made[members])
    return groups


def build_mesh(layout: Layout, device_type: str, timeout: timedelta) -> DeviceMesh:
    """The generation's mesh; every rank calls it once, first thing after its default group."""
    if layout.ep > 1:
        dims = EXPERT_MESH_DIMS
        shape: tuple[int, ...] = (layout.pp, layout.dp // layout.ep, layout.cp, layout.ep,
                                  layout.tp)
    else:
        dims, shape = MESH_DIMS, (layout.pp, layout.dp, layout.cp, layout.tp)
    if math.prod(shape) != dist.get_world_size():
        raise ValueError(f"the layout's mesh {dict(zip(dims, shape, strict=True))} has "
                         f"{math.prod(shape)} ranks, the world {dist.get_world_size()}")
    mesh = DeviceMesh.from_group(_dim_groups(shape, device_type, timeout), device_type,
                                 mesh=torch.arange(math.prod(shape)).reshape(shape),
                                 mesh_dim_names=dims)
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
