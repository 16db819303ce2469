"""The device mesh of a generation: dims (pp, dp, cp, tp), tp innermost.

Global ranks are node-major and tp is the fastest-varying dim, so a TP group is made of
consecutive ranks and never spans nodes as long as tp divides the devices per node.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.layout import Layout

MESH_DIMS = ("pp", "dp", "cp", "tp")


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    return init_device_mesh(
        device_type, (layout.pp, layout.dp, layout.cp, layout.tp), mesh_dim_names=MESH_DIMS
    )
