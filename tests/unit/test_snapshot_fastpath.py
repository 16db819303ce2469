"""The snapshot rewrite's fast path (checkpoint/snapshot_fastpath.py) writes what the full lookup
writes, follows in-place updates and hyper-parameter changes, and steps aside when a tensor is
replaced instead of updated. One process, no process group (DCP's single-process mode)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from checkpoint.snapshot_format import shard_name, step_dir
from checkpoint.snapshot_writer import rewrite_snapshot, save_snapshot
from checkpoint.state import Progress, TrainState

pytestmark = pytest.mark.unit


@pytest.fixture
def shm():
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None,
                                 prefix="ultrascale-test-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _train(state: TrainState) -> None:
    state.optimizer.zero_grad()
    state.model(torch.randn(3, 4)).square().sum().backward()
    state.optimizer.step()
    state.progress.step += 1
    state.progress.consumed_samples += 3


def _shard(root: Path, step: int) -> bytes:
    return (step_dir(root, step) / shard_name(0)).read_bytes()


def test_fast_path_writes_what_the_full_lookup_writes(shm: Path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    state = TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.01), Progress())
    _train(state)
    first = save_snapshot(state, shm / "a", layout={})
    assert first.template is not None
    template, coordinator = first.template, first.coordinator

    def both(step_root: str) -> tuple[bytes, bytes, object]:
        fast = rewrite_snapshot(state, shm / step_root, template, coordinator, layout={},
                                resolved=resolved)
        rewrite_snapshot(state, shm / f"{step_root}-full", template, coordinator, layout={})
        step = state.progress.step
        return _shard(shm / step_root, step), _shard(shm / f"{step_root}-full", step), fast

    _train(state)
    built = rewrite_snapshot(state, shm / "b", template, coordinator, layout={})
    resolved = built.resolved
    assert resolved is not None
    # In-place updates, a new learning rate and a new RNG state: all followed.
    _train(state)
    state.optimizer.param_groups[0]["lr"] = 0.005
    torch.rand(5)
    fast, full, writer = both("c")
    assert fast == full and writer.resolved is resolved
    # A parameter replaced, not updated: the views would read the old tensor; the fast path
    # steps aside, the full lookup runs and builds a new one.
    model[0].weight = nn.Parameter(model[0].weight.detach() * 2)
    state.optimizer.param_groups[0]["params"][0] = model[0].weight
    state.optimizer.state[model[0].weight] = state.optimizer.state.pop(
        next(p for p in state.optimizer.state if p is not model[0].weight and p.shape == (8, 4)))
    _train(state)
    fast, full, writer = both("d")
    assert fast == full and writer.resolved is not resolved and writer.resolved is not None
