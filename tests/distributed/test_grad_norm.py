"""parallel.grad_norm on real ranks: the norm DTensor would compute, without DTensor ops.

Four gloo ranks on a 2×2 mesh hold gradients sharded on one dimension, on both, on neither,
and a plain tensor (each rank's own, as a pipeline stage's would be); the norm must equal the
norm of the full tensors. The gradients of a column-parallel Linear that FSDP2 shards again
over dp (its weight's dim 0 sharded twice: _StridedShard) must give DTensor's own norm. A
Partial gradient must be refused (None), and scaling must scale every local shard.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from parallel.grad_norm import scale_, squared_norm
from tests.forkserver import forkserver

pytestmark = pytest.mark.distributed


def _worker(rank: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 4), rank=rank,
                            world_size=4, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = [torch.randn(6, 4), torch.randn(5, 6), torch.randn(7)]  # 5 rows: uneven shards
    placements = [(Shard(0), Replicate()), (Shard(0), Shard(1)), (Replicate(), Replicate())]
    grads = [distribute_tensor(t.clone(), mesh, p) for t, p in zip(full, placements, strict=True)]
    torch.manual_seed(rank)
    own = torch.randn(3)  # not a DTensor: this rank's alone, counted once
    got = squared_norm([*grads, own])
    expected = sum(float(t.square().sum()) for t in full) + float(own.square().sum())
    linear = torch.nn.Linear(8, 6)
    parallelize_module(linear, mesh["tp"], ColwiseParallel())
    fully_shard(linear, mesh=mesh["dp"])
    linear(torch.randn(5, 8)).square().sum().backward()
    fsdp_tp = [p.grad for p in linear.parameters()]
    strided = any(isinstance(p, _StridedShard) for g in fsdp_tp for p in g.placements)
    fsdp_tp_got = float(squared_norm(fsdp_tp))
    fsdp_tp_expected = float(torch.nn.utils.get_total_norm(fsdp_tp).full_tensor() ** 2)
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial(), Replicate()])
    refused = squared_norm([grads[0], partial])
    scale_(grads, torch.tensor(0.5))
    scaled = [g.full_tensor() for g in grads]
    torch.save({"got": float(got), "expected": expected, "refused": refused,
                "strided": strided, "fsdp_tp": (fsdp_tp_got, fsdp_tp_expected),
                "scaled": all(torch.equal(s, t * 0.5) for s, t in zip(scaled, full, strict=True))},
               f"{out}.{rank}")
    dist.destroy_process_group()


def test_squared_norm_and_scale_on_a_2d_mesh(tmp_path: Path):
    out = tmp_path / "out"
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(out)), nprocs=4,
                       start_method=forkserver())
    for rank in range(4):
        r = torch.load(f"{out}.{rank}", weights_only=False)
        assert r["got"] == pytest.approx(r["expected"], rel=1e-6), rank
        assert r["strided"], "the FSDP2 + TP weight is expected to be _StridedShard"
        assert r["fsdp_tp"][0] == pytest.approx(r["fsdp_tp"][1], rel=1e-6), rank
        assert r["refused"] is None
        assert r["scaled"]
