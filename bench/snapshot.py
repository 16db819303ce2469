"""How long a snapshot blocks the step, against a plain memory copy and a durable async_save.

    python -m bench.snapshot [--runs 5] [--size-mb 64 256]

One gloo rank holds an MLP of `size-mb` MB of fp32 parameters plus AdamW's two moments (so the
state is 3x that). For each size, medians of `runs`:

- memcpy: cloning every state tensor (the floor any in-memory copy pays);
- snapshot: `save_snapshot` into /dev/shm, end to end, and its copy and checksum parts (the
  first snapshot of a generation: a full DCP save);
- rewrite: `rewrite_snapshot`, every later snapshot of a generation (the same layout rewritten
  in place, no planning, no collective), and its parts;
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

WIDTH = 1024
MB = 1e6


def _state(size_mb: int) -> TrainState:
    layers = max(1, round(size_mb * MB / (WIDTH * WIDTH * 4)))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, WIDTH)).sum().backward()
    optimizer.step()
    return TrainState(model, optimizer, Progress())


def _tensors(state: TrainState) -> list[torch.Tensor]:
    out = [p.detach() for p in state.model.parameters()]
    for per_param in state.optimizer.state.values():
        out.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return out


def _state_bytes(state: TrainState) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def _measure(size_mb: int, runs: int) -> dict[str, list[float]]:
    state = _state(size_mb)
    times: dict[str, list[float]] = {k: [] for k in ("memcpy", "snapshot", "copy", "checksum",
                                                     "rewrite", "rcopy", "rchecksum", "async")}
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-bench-"))
    durable = Path(tempfile.mkdtemp(prefix="ultrascale-bench-"))
    try:
        for run in range(1, runs + 1):
            state.progress.step = run
            started = time.perf_counter()
            copies = [t.clone() for t in _tensors(state)]
            times["memcpy"].append(time.perf_counter() - started)
            del copies
            started = time.perf_counter()
            writer = save_snapshot(state, root, layout={"dp": 1})
            times["snapshot"].append(time.perf_counter() - started)
            times["copy"].append(writer.copy_seconds)
            times["checksum"].append(writer.checksum_seconds)
            # Every later snapshot of a generation: the same layout, rewritten in place.
            state.progress.step = run + runs
            started = time.perf_counter()
            again = rewrite_snapshot(state, root, writer.template, writer.coordinator,
                                     layout={"dp": 1})
            times["rewrite"].append(time.perf_counter() - started)
            times["rcopy"].append(again.copy_seconds)
            times["rchecksum"].append(again.checksum_seconds)
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
        times["bytes"] = [float(_state_bytes(state))]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(durable, ignore_errors=True)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size-mb", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(minutes=5))
    try:
        print(f"# medians of {args.runs} runs, 1 gloo rank, state = params + AdamW moments (fp32)")
        header = f"{'state MB':>8} {'operation':<22} {'median ms':>10} {'ms/MB':>7} {'vs memcpy':>9}"
        print(header)
        for size in args.size_mb:
            times = _measure(size, args.runs)
            mbytes = times.pop("bytes")[0] / MB
            floor = statistics.median(times["memcpy"])
            names = {
                "memcpy": "memcpy (clone)",
                "snapshot": "snapshot (blocking)",
                "copy": "  of which copy",
                "checksum": "  of which crc32c",
                "rewrite": "rewrite (blocking)",
                "rcopy": "  of which copy",
                "rchecksum": "  of which crc32c",
                "async": "async_save staging",
            }
            for key, name in names.items():
                med = statistics.median(times[key])
                print(f"{mbytes:>8.0f} {name:<22} {med * 1e3:>10.1f} {med * 1e3 / mbytes:>7.3f} "
                      f"{med / floor:>8.2f}x")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
