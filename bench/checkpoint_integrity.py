"""Checkpoint integrity at scale: who checksums, how fast, and what a restore waits for.

    python -m bench.checkpoint --integrity [--size-mb 2048] [--ranks 1,2,4] [--runs 3]

Two tables. First, the checksum algorithms on one core (GB/s over a 256 MB buffer). Second, one
checkpoint of the same total size saved by 1, 2 and 4 gloo ranks (a 1-D tensor sharded over the
ranks as a DTensor, so rank r writes and later reads `__r_0.distcp`), and per world size:
- old commit / old verify: rank 0 alone sha256-hashes every file (as version 1 did), while the
  other ranks wait; old restore = old verify, then a plain DCP load;
- new commit: the manifest from the checksums the ranks computed as they wrote (no re-read);
- new verify: every rank crc32c-checks the file it reads, in parallel; new restore = a DCP load
  through VerifyingReader (verify, agree, read).
Every restore is checked to bring back the saved values exactly. Times are from all ranks
starting to the last one finishing (barriers), medians of --runs.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from bench.ranks import init_gloo_rank, timed_across_ranks
from checkpoint.checksum import CURRENT, LEGACY
from checkpoint.checksummed_storage import ChecksummingWriter, VerifyingReader
from checkpoint.manifest import read_manifest, verify_reads, verify_whole, write_manifest
from daemon.procutil import free_port

MB = 1e6
_ALGO_BYTES = 256 << 20


def algorithm_speeds(runs: int) -> list[tuple[str, float]]:
    """(name, GB/s on one core) for each candidate checksum, median of `runs`."""
    data = memoryview(bytearray(torch.randint(0, 256, (_ALGO_BYTES,), dtype=torch.uint8).numpy()))
    algos: list[tuple[str, Callable[[], object]]] = [
        ("crc32c (SSE4.2)", lambda: crc32c.crc32c(data)),
        ("xxh3_64", lambda: xxhash.xxh3_64_intdigest(data)),
        ("xxh3_128", lambda: xxhash.xxh3_128_intdigest(data)),
        ("sha256 (version 1)", lambda: hashlib.sha256(data).digest()),
    ]
    out = []
    for name, fn in algos:
        seconds = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        out.append((name, _ALGO_BYTES / 1e9 / statistics.median(seconds)))
    return out



def _worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    init_gloo_rank(rank, world, port, timedelta(seconds=600))
    path = Path(cfg["work"]) / f"world{world}"
    numel = int(cfg["bytes"]) // 4 // world * world
    mesh = init_device_mesh("cpu", (world,))
    local = torch.arange(rank * (numel // world), (rank + 1) * (numel // world), dtype=torch.float32)
    state = {"w": DTensor.from_local(local, mesh, [Shard(0)])}
    writer = ChecksummingWriter(path)
    times: dict[str, list[float]] = {k: [] for k in (
        "save", "old commit", "new commit", "old verify", "new verify", "old restore",
        "new restore")}
    times["save"].append(timed_across_ranks(lambda: dcp.save(state, storage_writer=writer)))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=600))

    def commit(scheme: Any, files: Any) -> None:
        if rank == 0:
            write_manifest(path, step=0, consumed_samples=0, layout={}, files=files, scheme=scheme)

    legacy = new = None
    for _ in range(cfg["runs"]):
        times["old commit"].append(timed_across_ranks(lambda: commit(LEGACY, None)))
        legacy = read_manifest(path)
        times["new commit"].append(timed_across_ranks(lambda: commit(CURRENT, writer.files)))
        new = read_manifest(path)
    assert legacy is not None and new is not None
    assert (legacy.scheme, new.scheme) == (LEGACY, CURRENT)
    everything = [e.path for e in legacy.files]
    mine = f"__{rank}_0.distcp"
    target = {"w": DTensor.from_local(torch.zeros_like(local), mesh, [Shard(0)])}

    def old_verify() -> None:
        if rank == 0:
            verify_whole(path, legacy, everything)

    def new_verify() -> None:
        verify_reads(path, new, {mine: [(0, new.entry(mine).size)]})

    def old_restore() -> None:
        old_verify()
        dist.barrier()  # the others wait for rank 0's verdict before loading
        dcp.load(target, storage_reader=FileSystemReader(path))

    def new_restore() -> None:
        dcp.load(target, storage_reader=VerifyingReader(path, new, group=group), process_group=group)

    for _ in range(cfg["runs"]):
        for name, fn in (("old verify", old_verify), ("new verify", new_verify),
                         ("old restore", old_restore), ("new restore", new_restore)):
            target["w"].to_local().zero_()
            times[name].append(timed_across_ranks(fn))
            if name.endswith("restore"):
                assert torch.equal(target["w"].to_local(), local), f"{name}: values differ"
    if rank == 0:
        shard = max(e.size for e in new.files if e.path.endswith(".distcp"))
        result = {"times": times, "total": new.total_bytes, "largest": shard}
        (Path(cfg["work"]) / f"integrity_{world}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(work: Path, size_mb: float, worlds: list[int], runs: int) -> None:
    print(f"# checksum speed on one core, {_ALGO_BYTES >> 20} MiB buffer, median of {runs}")
    print(f"{'algorithm':<20} {'GB/s':>7}")
    for name, gbps in algorithm_speeds(runs):
        print(f"{name:<20} {gbps:>7.2f}")
    results = {}
    for world in worlds:
        cfg = {"work": str(work), "bytes": size_mb * MB, "runs": runs}
        mp.spawn(_worker, args=(world, free_port(), cfg), nprocs=world, join=True)
        results[world] = json.loads((work / f"integrity_{world}.json").read_text())
        for p in (work / f"world{world}").iterdir():
            p.unlink()  # keep one checkpoint on disk at a time
    print(f"\n# one checkpoint, same total, saved and restored by N ranks; median seconds of {runs}"
          " (save: 1 run); page cache not dropped, so verify and restore read from memory")
    names = list(results[worlds[0]]["times"])
    print(f"{'ranks':>5} {'total MB':>9} {'shard MB':>9} " + " ".join(f"{n:>11}" for n in names))
    for world, r in results.items():
        cells = " ".join(f"{statistics.median(r['times'][n]):>11.3f}" for n in names)
        print(f"{world:>5} {r['total'] / MB:>9.1f} {r['largest'] / MB:>9.1f} {cells}")
    first = results[worlds[0]]["times"]
    for world, r in results.items():
        t = r["times"]
        ratios = ", ".join(
            f"{n} {statistics.median(t[n]) / statistics.median(first[n]):.2f}"
            for n in ("old verify", "new verify", "old restore", "new restore"))
        print(f"# {world} ranks vs {worlds[0]}: {ratios}")
