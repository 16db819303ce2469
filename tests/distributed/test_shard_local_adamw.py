"""ShardLocalAdamW against torch's AdamW on the same DTensors: bit-identical, on real ranks.

Two gloo ranks hold two copies of one model: FSDP2-sharded weights in two parameter groups
(weight decay and none), a replicated parameter whose gradient arrives Partial (DTensor's path
must be kept for it), and amsgrad in a second run. Every step both optimizers see the same
gradients; parameters and optimizer state must match bit for bit.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from checkpoint.optimizer_state import zeros_like
from tests.forkserver import forkserver
from trainer.shard_local_adamw import ShardLocalAdamW

pytestmark = pytest.mark.distributed
STEPS = 4


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 12)
        self.down = torch.nn.Linear(12, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _run(optimizer_cls: type, mesh, amsgrad: bool) -> tuple[dict, list]:
    torch.manual_seed(0)
    model = _Model()
    fully_shard(model, mesh=mesh)
    # Replicated, with a Partial gradient: what a local-shard update must not take as-is.
    scale = torch.nn.Parameter(distribute_tensor(torch.ones(8), mesh, [Replicate()]))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = optimizer_cls([{"params": decay, "weight_decay": 0.1},
                         {"params": [*no_decay, scale], "weight_decay": 0.0}],
                        lr=1e-2, amsgrad=amsgrad)
    initial = [p.to_local().clone() for p in [*model.parameters(), scale]]
    for step in range(STEPS):
        torch.manual_seed(100 + step * dist.get_world_size() + dist.get_rank())
        model(torch.randn(4, 8)).square().mean().backward()
        scale.grad = DTensor.from_local(torch.randn(8), mesh, [Partial()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = [p.to_local().clone() for p in [*model.parameters(), scale]]
    state = [{k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in s.items()}
             for s in opt.state.values()]
    return {"params": params, "initial": initial}, state


def _zeros_like_differences(mesh) -> list[str]:
    """Where the priming `zeros_like` differs from torch's on DTensors: evenly and unevenly
    sharded (5 rows on 2 ranks), replicated, and Partial (left to torch)."""
    out = []
    for name, t in [("even", distribute_tensor(torch.randn(6, 3), mesh, [Shard(0)])),
                    ("uneven", distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])),
                    ("columns", distribute_tensor(torch.randn(3, 5), mesh, [Shard(1)])),
                    ("replicated", distribute_tensor(torch.randn(4), mesh, [Replicate()])),
                    ("partial", DTensor.from_local(torch.randn(4), mesh, [Partial()]))]:
        ours, ref = zeros_like(t), torch.zeros_like(t)
        got = (type(ours), ours.placements, ours.shape, ours.stride(), ours.to_local().shape,
               ours.to_local().stride(), ours.dtype, bool(ours.to_local().any()))
        want = (type(ref), ref.placements, ref.shape, ref.stride(), ref.to_local().shape,
                ref.to_local().stride(), ref.dtype, False)
        if got != want:
            out.append(f"{name}: {got} != {want}")
    return out


def _worker(rank: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for amsgrad in (False, True):
        results[amsgrad] = (_run(torch.optim.AdamW, mesh, amsgrad),
                            _run(ShardLocalAdamW, mesh, amsgrad))
    torch.save({"adamw": results, "zeros_like": _zeros_like_differences(mesh)}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_matches_torch_adamw_bit_for_bit(tmp_path: Path):
    out = tmp_path / "out"
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2,
                       start_method=forkserver())
    for rank in range(2):
        saved = torch.load(f"{out}.{rank}", weights_only=False)
        results = saved["adamw"]
        assert saved["zeros_like"] == [], f"rank {rank}: {saved['zeros_like']}"
        for amsgrad, ((ref_params, ref_state), (params, state)) in results.items():
            assert len(params["params"]) == len(ref_params["params"]) == 4
            for i, (a, b) in enumerate(zip(ref_params["params"], params["params"], strict=True)):
                assert torch.equal(a, b), f"rank {rank} amsgrad={amsgrad}: parameter {i} differs"
            assert len(state) == len(ref_state) == 4
            for s_ref, s in zip(ref_state, state, strict=True):
                assert s_ref.keys() == s.keys()
                for key in s_ref:
                    assert torch.equal(s_ref[key], s[key]), f"rank {rank}: state {key} differs"
            # Equal because both updated every parameter, not because neither did.
            for a, b in zip(params["initial"], params["params"], strict=True):
                assert not torch.equal(a, b)
