"""`parallel.materialize` allocates a parallelized model exactly as `to_empty` does.

Four gloo ranks on dp2 x tp2 with ZeRO-3 (FSDP2 over TP's DTensors: 2-D parameters) and
three on dp3 alone (shards of uneven size, padded by FSDP2): the same model built twice on one
mesh, one allocated by `nn.Module.to_empty`, the other by `materialize`. Every parameter must
come out the same DTensor (mesh, placements, global shape and stride, local shard), FSDP2 must
hold the module's parameter as its sharded parameter with the same padded shard, and after
drawing the same initial weights a forward and backward must give the same loss and
gradients, bit for bit.
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
from parallel.job import loads
from parallel.layout import resolve
from tests.forkserver import forkserver

pytestmark = pytest.mark.distributed

TIMEOUT = timedelta(seconds=60)
MODEL = ("[model]\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\n"
         "num_attention_heads = 4\nnum_key_value_heads = 2\nvocab_size = 64\n"
         "max_position_embeddings = 16\n[train]\nseq_len = 16\n[data]\nsource = \"python-stdlib\"\n")


def _fsdp_shards(model: torch.nn.Module) -> dict[str, tuple]:
    """Per FSDP2 parameter: whether the module holds FSDP's sharded parameter, and the padded
    shard's size."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                held = getattr(info.module, info.param_name) is fsdp_param.sharded_param
                out[f"{name}.{info.param_name}"] = (
                    held, tuple(fsdp_param._sharded_param_data.shape))
    return out


def _rank(rank: int, world: int, parallel: str, port: int, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from models import get_spec
    from parallel.materialize import materialize
    from parallel.mesh import build_mesh
    from parallel.parallelize import parallelize

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    cfg = loads(MODEL + parallel)
    layout = resolve(cfg, world)
    mesh = build_mesh(layout, "cpu", TIMEOUT)
    spec, cpu = get_spec(cfg.model.family), torch.device("cpu")

    def built(allocate) -> torch.nn.Module:
        model = spec.build(cfg.model)
        parts = parallelize(model, layout, mesh)
        allocate(model)
        spec.tie_weights(model)
        spec.init_weights(model, cfg.train.seed)
        for part in parts:
            part.init_buffers(cpu)
        return model

    reference = built(lambda m: m.to_empty(device=cpu))
    model = built(lambda m: materialize(m, cpu))
    mismatches = []
    for (name, want), (_, got) in zip(reference.named_parameters(), model.named_parameters(),
                                      strict=True):
        same = type(want) is type(got) and want.shape == got.shape and \
            want.stride() == got.stride() and want.dtype == got.dtype and \
            want.requires_grad == got.requires_grad
        if isinstance(want, DTensor):
            same = same and want.device_mesh == got.device_mesh and \
                want.placements == got.placements and \
                torch.equal(want.to_local(), got.to_local())
        else:
            same = same and torch.equal(want, got)
        if not same:
            mismatches.append(name)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for m in (reference, model):
        logits = m(tokens)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        loss = logits.float().pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                      for n, p in m.named_parameters() if p.grad is not None})
    shards = _fsdp_shards(model)
    result = {
        "mismatches": mismatches,
        "fsdp": shards == _fsdp_shards(reference),
        "fsdp_held": all(held for held, _ in shards.values()),
        "fsdp_params": len(shards),
        "losses": losses,
        "grads_equal": grads[0].keys() == grads[1].keys() and len(grads[0]) > 0 and all(
            torch.equal(grads[0][n], grads[1][n]) for n in grads[0]),
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.parametrize(("world", "parallel"), [
    (4, "[parallel]\ntp = 2\nzero = 3\n"),
    (3, "[parallel]\nzero = 3\n"),
], ids=["dp2-tp2-zero3", "dp3-zero3"])
def test_materialize_allocates_as_to_empty_does(tmp_path: Path, world: int, parallel: str):
    mp.start_processes(_rank, args=(world, parallel, free_port(), str(tmp_path)), nprocs=world,
                       start_method=forkserver())
    for rank in range(world):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["mismatches"] == [], (rank, result)
        assert result["fsdp"] and result["fsdp_held"] and result["fsdp_params"] > 0, (rank, result)
        assert result["losses"][0] == result["losses"][1], (rank, result)
        assert result["grads_equal"], (rank, result)
