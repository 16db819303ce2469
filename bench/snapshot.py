"""How long a snapshot blocks the step, against a plain copy and a durable async_save.

    python -m bench.snapshot [--runs 5] [--size-mb 64 256] [--device cpu|cuda]

One rank (gloo on CPU, nccl on a GPU) holds an MLP of `size-mb` MB of fp32 parameters plus
AdamW's two moments (so the state is 3x that), on `--device`. For each size, medians of `runs`:

- copy to buffer: every state tensor copied into host memory allocated once (pinned on a GPU,
  where it is a device-to-host copy): the floor any in-memory snapshot pays;
- memcpy (clone): every state tensor cloned, on its device (fresh memory every time);
- snapshot: `save_snapshot` into /dev/shm, end to end, and its copy and checksum parts (the
  first snapshot of a generation: a full DCP save);
- rewrite, every later snapshot of a generation (the same layout rewritten, no planning, no
  collective) as the worker takes it (`trainer.snapshots.Snapshots`): the time the step is held
  (the copy into the staging buffer only queued: on the writer thread on CPU, on a side stream
  on a GPU), until the copy is in host memory (what the next optimizer update waits for), and
  until the shard, its checksums and records are written (off the step);
- async_save staging: the time `dcp.async_save` blocks the caller (planning + staging the state
  to CPU memory) before it writes a durable checkpoint in the background.

Each snapshot is loaded back once and checked to equal the saved state.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from checkpoint.snapshot_reader import load_snapshot, local_fetch
from checkpoint.snapshot_store import SnapshotStore
from checkpoint.snapshot_writer import rewrite_snapshot, save_snapshot
from checkpoint.state import Progress, TrainState
from trainer.snapshots import Snapshots

WIDTH = 1024
MB = 1e6


def _state(size_mb: int, device: str) -> TrainState:
    layers = max(1, round(size_mb * MB / (WIDTH * WIDTH * 4)))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, WIDTH, device=device)).sum().backward()
    optimizer.step()
    return TrainState(model, optimizer, Progress())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _tensors(state: TrainState) -> list[torch.Tensor]:
    out = [p.detach() for p in state.model.parameters()]
    for per_param in state.optimizer.state.values():
        out.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return out


def _state_bytes(state: TrainState) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def _measure(size_mb: int, runs: int, device: str) -> dict[str, list[float]]:
    state = _state(size_mb, device)
    times: dict[str, list[float]] = {k: [] for k in (
        "buffer", "memcpy", "snapshot", "copy", "checksum", "held", "copied", "written",
        "async")}
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-bench-"))
    durable = Path(tempfile.mkdtemp(prefix="ultrascale-bench-"))
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device == "cuda")
               for t in _tensors(state)]
    for b in buffers:
        b.zero_()
    taken = Snapshots(root / "taken", 1, {"dp": 1}, print)
    try:
        for run in range(1, runs + 1):
            _sync(device)
            started = time.perf_counter()
            for b, t in zip(buffers, _tensors(state), strict=True):
                b.copy_(t, non_blocking=True)
            _sync(device)
            times["buffer"].append(time.perf_counter() - started)
            started = time.perf_counter()
            copies = [t.clone() for t in _tensors(state)]
            _sync(device)
            times["memcpy"].append(time.perf_counter() - started)
            del copies
            state.progress.step = run
            started = time.perf_counter()
            writer = save_snapshot(state, root, layout={"dp": 1})
            times["snapshot"].append(time.perf_counter() - started)
            times["copy"].append(writer.copy_seconds)
            times["checksum"].append(writer.checksum_seconds)
            # Every later snapshot of a generation: the same layout, rewritten in one go.
            state.progress.step = run + runs
            rewrite_snapshot(state, root, writer.template, writer.coordinator, layout={"dp": 1})
            # As the worker takes it: the first take is a full save, every later one staged.
            if taken.next_is_full:
                assert taken.take(state) and taken.drain()
            state.progress.step = run + 2 * runs
            _sync(device)
            started = time.perf_counter()
            assert taken.take(state)
            times["held"].append(time.perf_counter() - started)
            taken.fence()  # as the next update: the copy made (CPU) or queued before (GPU)
            _sync(device)
            times["copied"].append(time.perf_counter() - started)
            assert taken.drain()
            times["written"].append(time.perf_counter() - started)
            state.progress.step = run
            SnapshotStore(root).prune()
            started = time.perf_counter()
            future = dcp.async_save({"state": state}, checkpoint_id=str(durable / f"step_{run}"))
            times["async"].append(time.perf_counter() - started)
            future.result()
        saved = [t.clone() for t in _tensors(state)]
        for t in _tensors(state):
            t.zero_()
        load_snapshot(state, 2 * runs, local_fetch(root, 2 * runs))  # the last rewrite
        assert all(torch.equal(a, b) for a, b in zip(saved, _tensors(state), strict=True))
        for t in _tensors(state):
            t.zero_()
        load_snapshot(state, 3 * runs, local_fetch(root / "taken", 3 * runs))  # the last taken
        assert all(torch.equal(a, b) for a, b in zip(saved, _tensors(state), strict=True))
        times["bytes"] = [float(_state_bytes(state))]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(durable, ignore_errors=True)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size-mb", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU here")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"  # async_save: gloo too
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            timeout=timedelta(minutes=5),
                            device_id=torch.device("cuda", 0) if args.device == "cuda" else None)
    try:
        print(f"# medians of {args.runs} runs, 1 {backend} rank on {args.device}, state = params "
              f"+ AdamW moments (fp32)")
        header = f"{'state MB':>8} {'operation':<26} {'median ms':>10} {'ms/MB':>7} {'vs copy':>8}"
        print(header)
        for size in args.size_mb:
            times = _measure(size, args.runs, args.device)
            mbytes = times.pop("bytes")[0] / MB
            floor = statistics.median(times["buffer"])
            names = {
                "buffer": "copy to buffer",
                "memcpy": "memcpy (clone)",
                "snapshot": "snapshot (blocking)",
                "copy": "  of which copy",
                "checksum": "  of which crc32c",
                "held": "rewrite taken: step held",
                "copied": "  until copied",
                "written": "  until written",
                "async": "async_save staging",
            }
            for key, name in names.items():
                med = statistics.median(times[key])
                print(f"{mbytes:>8.0f} {name:<26} {med * 1e3:>10.2f} {med * 1e3 / mbytes:>7.3f} "
                      f"{med / floor:>7.2f}x")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
