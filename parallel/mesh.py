"""The device mesh of a generation: dims (pp, dp, cp, tp), tp innermost.

Global ranks are node-major and tp is the fastest-varying dim, so a TP group is made of
consecutive ranks and never spans nodes as long as tp divides the devices per node.

Every sub-group gets the job's process-group timeout. `init_device_mesh` otherwise creates
them with torch's default (30 minutes), whatever the default group's timeout: a rank that
vanished mid-collective would then hold its TP or DP peers for half an hour.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.layout import Layout

MESH_DIMS = ("pp", "dp", "cp", "tp")


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


def build_mesh(layout: Layout, device_type: str, timeout: timedelta) -> DeviceMesh:
    return init_device_mesh(
        device_type,
        (layout.pp, layout.dp, layout.cp, layout.tp),
        mesh_dim_names=MESH_DIMS,
        backend_override={dim: _timeout_options(device_type, timeout) for dim in MESH_DIMS},
    )
