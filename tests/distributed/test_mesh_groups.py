"""A generation's mesh: every dim's group holds the right ranks, and a rank makes only its own.

Eight gloo ranks build the meshes of four layouts in turn (each in a world of its own, as every
generation is): pp2 x tp2 x dp2, cp2 x dp4 (a flattened dp x cp), ep2 x dp8 (the flattened
dp of edp x ep) and dp8. For each dim the group's ranks must be the ones `torch.arange(8)`
laid out over the dims puts on this rank's line, and an all-reduce of the global rank over it
must give their sum. Process-group constructions on this rank while the mesh is built are
counted: at most one per root dim and one per group of a flattened dim, whatever the world
(`init_device_mesh` made one per group of every dim, members or not: 24 on dp8).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from daemon.procutil import free_port
from tests.forkserver import forkserver

pytestmark = pytest.mark.distributed

WORLD = 8
TIMEOUT = timedelta(seconds=60)
# name: (Layout fields, dims and shape of the root mesh, flattened dims: groups of this many)
CASES = {
    "pp2-tp2-dp2": ({"pp": 2, "tp": 2, "dp": 2}, ("pp", "dp", "cp", "tp"), (2, 2, 1, 2), {}),
    "cp2-dp4": ({"cp": 2, "dp": 4}, ("pp", "dp", "cp", "tp"), (1, 4, 2, 1), {"dp_cp": 8}),
    "ep2-dp8": ({"ep": 2, "dp": 8}, ("pp", "edp", "cp", "ep", "tp"), (1, 4, 1, 2, 1),
                {"dp": 8}),
    "dp8": ({"dp": 8}, ("pp", "dp", "cp", "tp"), (1, 8, 1, 1), {}),
}


def _expected_line(shape: tuple[int, ...], rank: int, dim: int) -> list[int]:
    grid = torch.arange(WORLD).reshape(shape)
    where = [int(c) for c in (grid == rank).nonzero()[0]]
    where[dim] = slice(None)  # type: ignore[call-overload]
    return grid[tuple(where)].flatten().tolist()


def _rank(rank: int, ports: dict[str, int], out: str) -> None:
    import torch.distributed.distributed_c10d as c10d

    from parallel.layout import Layout
    from parallel.mesh import build_mesh, data_mesh

    torch.set_num_threads(1)
    made = 0
    helper = c10d._new_process_group_helper

    def counting(*args, **kwargs):
        nonlocal made
        made += 1
        return helper(*args, **kwargs)

    result: dict[str, dict] = {}
    for name, (fields, dims, _, _) in CASES.items():
        store = dist.TCPStore("127.0.0.1", ports[name], WORLD, is_master=rank == 0,
                              timeout=TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                                timeout=TIMEOUT)
        made = 0
        c10d._new_process_group_helper = counting
        try:
            mesh = build_mesh(Layout(**fields), "cpu", timedelta(seconds=30))
        finally:
            c10d._new_process_group_helper = helper
        groups = {d: dist.get_process_group_ranks(mesh[d].get_group()) for d in dims}
        sums = {}
        for d in dims:
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=mesh[d].get_group())
            sums[d] = value.item()
        data = data_mesh(mesh).get_group()
        result[name] = {"made": made, "groups": groups, "sums": sums,
                        "data": dist.get_process_group_ranks(data)}
        dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def test_every_dim_holds_its_line_and_a_rank_makes_only_its_groups(tmp_path: Path) -> None:
    ports = {name: free_port() for name in CASES}
    mp.start_processes(_rank, args=(ports, str(tmp_path)), nprocs=WORLD,
                       start_method=forkserver())
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, (_, dims, shape, flat) in CASES.items():
            got = result[name]
            for i, d in enumerate(dims):
                line = _expected_line(shape, rank, i)
                assert got["groups"][d] == line, (name, rank, d, got["groups"][d])
                assert got["sums"][d] == float(sum(line)), (name, rank, d)
            # the data-parallel group: dp (x cp), the flattened one where there is one
            assert len(got["data"]) == (shape[1] * shape[2] if dims[1] == "dp"
                                        else shape[1] * shape[3] * shape[2]), (name, got["data"])
            assert rank in got["data"]
            # one group per root dim at most (those of size 1 share one, one over the whole
            # world is the default group), and one per group of each flattened dim
            bound = len(dims) + sum(WORLD // size for size in flat.values())
            assert got["made"] <= bound, (name, rank, got["made"], bound)
