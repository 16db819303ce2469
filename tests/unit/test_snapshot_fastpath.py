"""The snapshot rewrite's fast path (checkpoint/snapshot_fastpath.py) writes what the full lookup
writes, follows in-place updates and hyper-parameter changes, and steps aside when a tensor is
replaced instead of updated. One process, no process group (DCP's single-process mode)."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from checkpoint.snapshot_fastpath import ByteValues
from checkpoint.snapshot_format import chunk_checksums, record_name, shard_name, slot, step_dir
from checkpoint.snapshot_staging import HostStaging
from checkpoint.snapshot_writer import rewrite_snapshot, save_snapshot
from checkpoint.state import Progress, TrainState

pytestmark = pytest.mark.unit


def _train(state: TrainState) -> None:
    state.optimizer.zero_grad()
    state.model(torch.randn(3, 4)).square().sum().backward()
    state.optimizer.step()
    state.progress.step += 1
    state.progress.consumed_samples += 3


def _shard(root: Path, step: int) -> bytes:
    """The shard of rank 0, checked against the chunk checksums its record holds."""
    data = (step_dir(root, step) / shard_name(0)).read_bytes()
    record = json.loads((step_dir(root, step) / record_name(0)).read_text())
    assert record["size"] == len(data) and tuple(record["chunks"]) == chunk_checksums(data)
    return data


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


def _new_memory(state: TrainState) -> None:
    weight = state.model[0].weight
    weight.data = weight.data.clone()  # the same parameter object, other memory


def _optimizer_reloaded(state: TrainState) -> None:
    state.optimizer.load_state_dict(state.optimizer.state_dict())  # new state tensors


def _groups_replaced(state: TrainState) -> None:
    state.optimizer.param_groups = [dict(g, lr=0.003) for g in state.optimizer.param_groups]


def _module_replaced(state: TrainState) -> None:
    old = state.model[2]
    new = copy.deepcopy(old)
    state.model[2] = new
    for before, after in zip(old.parameters(), new.parameters(), strict=True):
        params = state.optimizer.param_groups[0]["params"]
        params[next(i for i, p in enumerate(params) if p is before)] = after
        state.optimizer.state[after] = state.optimizer.state.pop(before)


@pytest.mark.parametrize("change", [_new_memory, _optimizer_reloaded, _groups_replaced,
                                    _module_replaced])
def test_the_fast_path_steps_aside_when_the_state_is_rebuilt_not_updated(shm: Path, change):
    """Each way a tensor or a hyper-parameter can leave the place the fast path reads it from
    is noticed before a rewrite uses it; that rewrite writes what the full lookup writes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    state = TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.01), Progress())
    _train(state)
    first = save_snapshot(state, shm / "a", layout={})
    template, coordinator = first.template, first.coordinator
    _train(state)
    resolved = rewrite_snapshot(state, shm / "b", template, coordinator, layout={}).resolved
    assert resolved is not None and resolved.usable()
    change(state)
    assert not resolved.usable()
    _train(state)
    fast = rewrite_snapshot(state, shm / "c", template, coordinator, layout={},
                            resolved=resolved)
    rewrite_snapshot(state, shm / "c-full", template, coordinator, layout={})
    step = state.progress.step
    assert _shard(shm / "c", step) == _shard(shm / "c-full", step)
    assert fast.resolved is not resolved and fast.resolved is not None
    assert fast.resolved.usable()


def test_chunk_checksums_of_pieces_match_the_whole_file():
    import random

    from checkpoint.snapshot_writer import chunk_checksums_of

    rng = random.Random(0)
    data = rng.randbytes(1000)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, 20)))
        pieces = [memoryview(data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)],
                                                        strict=True)]
        for chunk_bytes in (7, 64, 100, 1000, 4096):  # pieces cross chunk boundaries or not
            assert chunk_checksums_of(pieces, chunk_bytes) == \
                chunk_checksums(data, chunk_bytes)
    assert chunk_checksums_of([memoryview(b""), memoryview(b"")]) == ()


def test_a_shard_is_written_whole_across_short_writes_and_iov_max(shm: Path, monkeypatch):
    import os

    from checkpoint import snapshot_format

    real = os.pwritev
    calls: list[int] = []

    def at_most_100_bytes(fd: int, buffers: list, offset: int) -> int:
        calls.append(len(buffers))
        # A short write that ends inside a buffer, as a full tmpfs (or a signal) may cause.
        return real(fd, [bytes(b"".join(bytes(b) for b in buffers)[:100])], offset)

    monkeypatch.setattr(snapshot_format, "_IOV_MAX", 16)
    monkeypatch.setattr(snapshot_format.os, "pwritev", at_most_100_bytes)
    pieces = [bytes([i % 251]) * (i % 13) for i in range(200)]  # empty ones included
    path = shm / "shard"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        snapshot_format.pwritev_all(fd, [memoryview(p) for p in pieces])
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(pieces)
    assert max(calls) <= 16 and len(calls) >= sum(map(len, pieces)) // 100


def _byte_staging(lengths: list[int]) -> HostStaging:
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    return HostStaging(tuple((None, o, n) for o, n in zip(offsets, lengths, strict=True)),
                       sum(lengths), [], torch.device("cpu"))


def _slot_of(staging: HostStaging, index: int) -> bytes:
    _, offset, length = staging.items[index]
    return bytes(staging.memory()[offset:offset + length])


def test_a_byte_value_is_pickled_into_its_slots_again_unless_the_same_immutable_value():
    staging = _byte_staging([64, 64, 64])
    holders = ((0, 2), (1,))  # value 0 goes to items 0 and 2, value 1 to item 1
    staging.put_values(ByteValues((0.5, (0.9, 0.999)), holders))
    assert [_slot_of(staging, i) for i in range(3)] == [
        slot(pickle.dumps(0.5), 64), slot(pickle.dumps((0.9, 0.999)), 64),
        slot(pickle.dumps(0.5), 64)]

    def scribble() -> None:  # marks every slot, to see which ones a put writes again
        staging.memory()[:] = b"\xff" * len(staging.memory())

    scribble()
    staging.put_values(ByteValues((0.5, (0.9, 0.999)), holders))  # the same: nothing written
    assert _slot_of(staging, 0) == _slot_of(staging, 1) == b"\xff" * 64
    # Values that compare equal but pickle differently, and a value changed in place: written.
    box = [1]
    for before, after in ((0.0, -0.0), (1, 1.0), (1, True), (float("nan"), float("nan")),
                          (box, box)):
        staging.put_values(ByteValues((before, 7), holders))
        if after is box:
            box.append(2)
        scribble()
        staging.put_values(ByteValues((after, 7), holders))
        assert _slot_of(staging, 0) == _slot_of(staging, 2) == slot(pickle.dumps(after), 64)
        assert _slot_of(staging, 1) == b"\xff" * 64
    # Another layout of values over the items (a new fast path, the full lookup): all written.
    scribble()
    staging.put_values(ByteValues((1, 7), tuple(list(holders))))  # equal, not the same
    assert b"\xff" * 64 not in [_slot_of(staging, i) for i in range(3)]
    # A value that outgrows its slot fails the put; the next one writes every slot again.
    with pytest.raises(ValueError):
        staging.put_values(ByteValues((1, "x" * 100), holders))
    scribble()
    staging.put_values(ByteValues((1, 7), holders))
    assert b"\xff" * 64 not in [_slot_of(staging, i) for i in range(3)]
