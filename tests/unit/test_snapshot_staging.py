"""A snapshot rewrite holds the step only while it fixes what to copy
(checkpoint/snapshot_staging.py): the copy, the shard's write, checksums and records happen on
the rank's writer thread, the next optimizer update waits for the copy, the snapshot holds the
values of the step it was taken at even when training has already changed the state, and a
write that fails there is logged and counted. One process, no process group (DCP's single-process
mode); the last test needs a GPU (run it where one is lent)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import checkpoint.snapshot_staging as staging_module
from checkpoint.snapshot_format import record_name, shard_name, step_dir
from checkpoint.snapshot_reader import load_snapshot, local_fetch
from checkpoint.snapshot_staging import HostStaging
from checkpoint.state import Progress, TrainState
from trainer.snapshots import Snapshots
from trainer.thread_names import SNAPSHOT_WRITER

pytestmark = pytest.mark.unit


def _state(device: str = "cpu") -> TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    return TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.01), Progress())


def _train(state: TrainState, before_update=lambda: None) -> None:
    device = next(state.model.parameters()).device
    state.optimizer.zero_grad()
    state.model(torch.randn(3, 16, device=device)).square().sum().backward()
    before_update()
    state.optimizer.step()
    state.progress.step += 1
    state.progress.consumed_samples += 3


def _values(state: TrainState) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in state.model.state_dict().items()}
    for i, per_param in enumerate(state.optimizer.state.values()):
        out |= {f"optim.{i}.{k}": v.detach().cpu().clone() for k, v in per_param.items()}
    return out


def _restored(root: Path, step: int) -> dict[str, torch.Tensor]:
    fresh = _state()
    _train(fresh)  # optimizer state exists, with other values
    load_snapshot(fresh, step, local_fetch(root, step))
    assert fresh.progress.step == step
    return _values(fresh)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_the_write_comes_after_the_step_with_the_step_values(shm, monkeypatch):
    state = _state()
    logged: list[str] = []
    snapshots = Snapshots(shm, 1, {}, logged.append)
    _train(state)
    assert snapshots.take(state)  # the generation's first: a full save, on the step
    assert (step_dir(shm, 1) / record_name(0)).is_file()

    # Hold the writer thread where it would create the shard file.
    release, reached = threading.Event(), threading.Event()
    create = staging_module.create_private_file

    def held_create(path, *args, **kwargs):
        reached.set()
        assert release.wait(30), "the test never released the writer"
        return create(path, *args, **kwargs)

    monkeypatch.setattr(staging_module, "create_private_file", held_create)
    _train(state, snapshots.fence)
    want = _values(state)
    assert snapshots.take(state)  # returns with its write held: the write is off the step
    assert reached.wait(30)
    assert not (step_dir(shm, 2) / shard_name(0)).exists()
    _train(state, snapshots.fence)  # the next step changes every tensor in place
    assert not _values(state)["model.0.weight"].equal(want["model.0.weight"])
    release.set()
    assert snapshots.drain() and snapshots.failures == 0 and not logged
    _assert_equal(_restored(shm, 2), want)


def test_on_cpu_the_copy_runs_off_the_step_and_the_next_update_waits_for_it(shm, monkeypatch):
    state = _state()
    snapshots = Snapshots(shm, 1, {}, print)
    _train(state)
    assert snapshots.take(state)  # the generation's first: a full save, on the step
    _train(state, snapshots.fence)
    assert snapshots.take(state) and snapshots.drain()  # the first rewrite

    # Hold the writer thread where it would make the copy.
    release, reached = threading.Event(), threading.Event()
    complete = HostStaging.complete

    def held_complete(self):
        reached.set()
        assert release.wait(30), "the test never released the writer"
        complete(self)

    monkeypatch.setattr(HostStaging, "complete", held_complete)
    # The update's wait, as the step's thread sees it: when it ended, and what the staging
    # counted of it.
    fence = HostStaging.fence
    waits: list[tuple[float, float]] = []
    entered = threading.Event()

    def timed_fence(self):
        entered.set()
        waited = fence(self)
        waits.append((time.monotonic(), waited))
        return waited

    monkeypatch.setattr(HostStaging, "fence", timed_fence)
    _train(state, snapshots.fence)
    want = _values(state)
    waits.clear()
    entered.clear()
    assert snapshots.take(state)  # returns with its copy not made: the copy is off the step
    assert reached.wait(30)
    # The next step runs until its update, which waits for the copy.
    stepped = threading.Thread(target=_train, args=(state, snapshots.fence))
    stepped.start()
    assert entered.wait(30)
    stepped.join(0.3)
    assert stepped.is_alive(), "the update did not wait for the snapshot's copy"
    _assert_equal(_values(state), want)
    released = time.monotonic()
    release.set()
    stepped.join(30)
    assert not stepped.is_alive()
    assert not _values(state)["model.0.weight"].equal(want["model.0.weight"])
    [(ended, waited)] = waits
    assert ended >= released and waited > 0  # it went on only once the copy was made
    # The update's wait is the held snapshot's: it counts in the next snapshot's blocking time.
    assert snapshots.take(state) and snapshots.blocking_seconds >= waited
    assert snapshots.drain() and snapshots.failures == 0
    _assert_equal(_restored(shm, 3), want)


def _writer_threads() -> set[str]:
    """The ids of this process's threads named as snapshot writers (a failed test before this
    one may have left its own)."""
    return {task.name for task in Path("/proc/self/task").iterdir()
            if (task / "comm").read_text().strip() == SNAPSHOT_WRITER}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_the_writer_thread_is_named_for_top_and_pinning(shm):
    """`top -H`, and bench.overhead --pin (which keeps it off the training core), see it."""
    state = _state()
    snapshots = Snapshots(shm, 1, {}, print)
    before = _writer_threads()
    # The first is a full save on the step; the second starts the writer thread, which names
    # itself before it writes; the third waits for that write.
    for _ in range(3):
        _train(state, snapshots.fence)
        assert snapshots.take(state)
    assert len(_writer_threads() - before) == 1
    assert snapshots.drain()


def test_every_rewrite_restores_its_own_step(shm):
    state = _state()
    snapshots = Snapshots(shm, 1, {}, print)
    wanted = {}
    for _ in range(4):
        _train(state, snapshots.fence)
        wanted[state.progress.step] = _values(state)
        assert snapshots.take(state)
    assert snapshots.drain() and snapshots.failures == 0
    for step, want in wanted.items():
        _assert_equal(_restored(shm, step), want)


def test_a_write_that_fails_off_the_step_is_logged_counted_and_leaves_no_record(shm):
    state = _state()
    logged: list[str] = []
    snapshots = Snapshots(shm, 1, {}, logged.append)
    _train(state)
    assert snapshots.take(state)
    _train(state)
    # Something already holds step 2's shard name: the write (O_EXCL) must refuse it.
    step_dir(shm, 2).mkdir(mode=0o700)
    (step_dir(shm, 2) / shard_name(0)).write_bytes(b"planted")
    assert snapshots.take(state)  # the copy itself succeeded
    assert not snapshots.drain()
    assert snapshots.failures == 1
    assert len(logged) == 1 and "snapshot of step 2 failed on rank 0" in logged[0], logged
    assert (step_dir(shm, 2) / shard_name(0)).read_bytes() == b"planted"
    assert not (step_dir(shm, 2) / record_name(0)).exists()
    # The next one is taken and written as usual.
    _train(state)
    want = _values(state)
    assert snapshots.take(state) and snapshots.drain()
    _assert_equal(_restored(shm, 3), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run where one is lent)")
def test_on_a_gpu_the_copy_is_a_device_to_host_copy_the_update_waits_for(shm):
    state = _state("cuda")
    snapshots = Snapshots(shm, 1, {}, print)
    _train(state, snapshots.fence)
    assert snapshots.take(state)
    assert snapshots._staging is None  # noqa: SLF001  (the first is a full save)
    wanted = {}
    for _ in range(5):
        _train(state, snapshots.fence)
        wanted[state.progress.step] = _values(state)
        assert snapshots.take(state)
    staging = snapshots._staging  # noqa: SLF001
    assert staging is not None and staging.buffer.is_pinned() and staging.stream is not None
    assert snapshots.drain() and snapshots.failures == 0
    for step, want in wanted.items():
        _assert_equal(_restored(shm, step), want)


def _bits(n: int, seed: int) -> torch.Tensor:
    """`n` random bytes, NaN payloads and signalling-NaN patterns of float32 among them."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    words = raw[: n - n % 4].view(torch.int32)
    words[::3] = 0x7F800001  # a signalling NaN
    words[1::3] = -0x3FFFFF  # 0xFFC00001: a quiet NaN with a payload, sign set
    return raw


def test_a_copy_plan_copies_runs_of_adjacent_items_whole_and_every_bit_as_it_is():
    # Items: [0, 8) and [8, 20) adjacent and 4-aligned; [24, 30) after a gap, 6 bytes (bf16);
    # [30, 46) read anew each time (as the RNG state is); [46, 53) odd-sized, after it.
    spans = [(0, 8), (8, 12), (24, 6), (30, 16), (46, 7)]
    staging = HostStaging(tuple((None, o, n) for o, n in spans), 53, list(range(len(spans))),
                          torch.device("cpu"))
    live = [_bits(8, 0), _bits(12, 1), _bits(6, 2).view(torch.bfloat16), None, _bits(7, 4)]
    fresh = iter(_bits(16, 10 + i) for i in range(3))
    served: list[torch.Tensor] = []

    def anew() -> torch.Tensor:
        served.append(next(fresh))
        return served[-1]

    views = [(t.view(torch.uint8) if t is not None else None) for t in live]
    resolved = SimpleNamespace(tensors=tuple((v, v if v is not None else anew) for v in views))
    for i in range(2):
        staging.copy_resolved(resolved)  # type: ignore[arg-type]
        # Queued, not made; the item read anew was read now (the RNG state of this step).
        assert len(served) == i + 1 and staging._queued is not None  # noqa: SLF001
        staging.complete()
        want = bytearray(53)
        for (offset, length), view in zip(spans, [*views[:3], served[-1], views[4]],
                                          strict=True):
            want[offset:offset + length] = bytes(view.numpy())
        assert bytes(staging.buffer.numpy()) == bytes(want)
        for t in (live[0], live[1]):  # the live tensors change in place: the next copy follows
            t.add_(1)
    plan = staging._plan  # noqa: SLF001
    assert plan is not None and plan.resolved is resolved
    # One concatenation for the two adjacent items (as float32), one each for the items the
    # gap and the fresh item separate (uint8: 6 and 7 bytes), the fresh item alone.
    assert [(len(run.sources), run.out.dtype) for run in plan.runs] == [
        (2, torch.float32), (1, torch.uint8), (1, torch.uint8)]
    assert len(plan.alone) == 1 and len(served) == 2
