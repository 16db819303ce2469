"""The job's mesh dimensions, declared once.

Each dimension is a field of `parallel.layout.Layout` and of `[parallel]`, a mesh dimension (or,
for ep, a split of one), and a technique module that applies it. Everything that lists, checks,
prints or exports dimensions reads `DIMS`: the layout's and the job's checks, the re-plan and
search dimensions, the world size, the step line, `ultra_mesh_size{dim}`, GetStatus and
`ultractl status`. Adding a dimension is one entry here plus its technique module, plus its
place in the device mesh: `parallel.mesh` owns the order of the mesh's dims (tp innermost) and
the flattened groups (dp over edp x ep, the data group over dp x cp), which are about devices,
not about what a dimension means.

Pure (no torch): the agent and the job parser import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MeshDim:
    name: str  # the Layout and [parallel] field
    meaning: str
    technique: str  # the module that applies it
    # Another dimension this one splits instead of adding devices of its own: ep takes its
    # ranks from dp (torchtitan's rule dp_shard x cp x tp = efsdp x ep, here with cp = tp = 1
    # inside ep), so it must divide it and the world size is not multiplied by it.
    within: str = ""
    why_within: str = ""
    # The layout search and a re-plan may choose it; dp is not chosen, it follows the world.
    searchable: bool = True


DIMS: tuple[MeshDim, ...] = (
    MeshDim("dp", "data parallelism: replicas (ZeRO-sharded) over different samples",
            "parallel.zero", searchable=False),
    MeshDim("tp", "tensor parallelism: each layer's matrices split over the ranks",
            "parallel.tensor_parallel"),
    MeshDim("pp", "pipeline parallelism: consecutive layers on consecutive stages",
            "parallel.pipeline"),
    MeshDim("cp", "context parallelism: each sequence split, attention as a ring",
            "parallel.context_parallel"),
    MeshDim("ep", "expert parallelism: the routed experts split over ep of the dp ranks",
            "parallel.expert_parallel", within="dp",
            why_within="expert parallelism takes its ranks from data parallelism"),
)
NAMES: tuple[str, ...] = tuple(d.name for d in DIMS)
# Dimensions that multiply the world size (dp x tp x pp x cp).
DEVICE_DIMS: tuple[str, ...] = tuple(d.name for d in DIMS if not d.within)
SEARCHABLE: tuple[str, ...] = tuple(d.name for d in DIMS if d.searchable)


def sizes(layout: Any) -> dict[str, int]:
    """Every dimension's size in `layout` (anything with the fields), in `DIMS` order."""
    return {name: int(getattr(layout, name)) for name in NAMES}


def nesting_problem(values: Mapping[str, int]) -> str:
    """Why `values` break a `within` rule (a split that does not divide what it splits), or ""."""
    for d in DIMS:
        if d.within and values[d.within] % values[d.name]:
            return (f"parallel.{d.name} must divide {d.within}: {d.why_within} (got "
                    f"{d.name} {values[d.name]}, {d.within} {values[d.within]})")
    return ""
