"""What the start of a restored generation costs as the world grows.

    python -m bench.restore_scale [--mesh-worlds 2,4,8,16] [--worlds 8,64,256,1024] [--runs 3]

Two tables, medians over `--runs`:

1. **The device mesh**, in real gloo worlds of `--mesh-worlds` ranks (processes on loopback, one
   thread each), for the layout of a data-parallel job (dp = world; pp, cp and tp of size 1):
   `build_mesh` (parallel/mesh.py: each rank makes only its own group of each dim) against
   torch's `init_device_mesh` with the same timeouts, which is what `build_mesh` called before.
   Rank 0's time after a barrier, after one untimed round of both. Every generation's start
   pays it.
2. **A snapshot's metadata on every restoring rank**, simulated in one process for a model of
   the shape of a 1B Llama (16 layers, hidden 2048, ffn 8192, vocab 32000: 147 tensors, 441
   with AdamW's two moments) saved by W FSDP ranks (one chunk of each tensor per rank, the
   items laid out as the snapshot writer lays them out) and restored on W - 1, in two forms:
   - DCP's pickled `Metadata`, what a snapshot's `.metadata` was until the index replaced it:
     unpickling it through the allow-list it went through (checkpoint/safe_unpickle.py's, with
     `SnapshotItem`, which that list no longer needs), checking its storage
     items, and DCP's plan of one rank's reads over every saved chunk
     (`create_read_items_for_chunk_list`, what the load planner calls per tensor);
   - the index a snapshot's `.metadata` is now (checkpoint/snapshot_index.py): parsing and
     checking it (`SnapshotIndex.parse`, `check_files`), picking the saved chunks that overlap
     the rank's own (`skeleton`, `narrow`), and DCP's plan over those alone.
   Both plans must read exactly the rank's elements. The "write" columns are the coordinator's
   work at a generation's first snapshot (pickling and checking the pickle before; building,
   serialising and parsing the index now). No tensor is trained or moved: these are the costs
   that grow with W whatever the model's size.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import pickle
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from checkpoint.safe_unpickle import _METADATA_GLOBALS, _MetadataUnpickler
from checkpoint.snapshot_format import SnapshotItem
from checkpoint.snapshot_index import SnapshotIndex

TIMEOUT = timedelta(seconds=60)  # the job's, as every generation's default group has it



class _SnapshotMetadataUnpickler(_MetadataUnpickler):
    """The allow-list a snapshot's `.metadata` went through while it was DCP's pickle: DCP's
    classes and `SnapshotItem`, which checkpoint/safe_unpickle.py no longer allows."""

    allowed = MappingProxyType({**_METADATA_GLOBALS,
                                (SnapshotItem.__module__, SnapshotItem.__qualname__): SnapshotItem})


def load_metadata(blob: bytes) -> Metadata:
    metadata = _SnapshotMetadataUnpickler(io.BytesIO(blob)).load()
    if not isinstance(metadata, Metadata):
        raise AssertionError("the simulated metadata did not come back")
    return metadata


# (rows, cols) of a 1B Llama's parameters; optimizer moments have the same shapes.
HIDDEN, FFN, VOCAB, LAYERS, KV = 2048, 8192, 32000, 16, 512
_LAYER = [(HIDDEN,), (HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN,),
          (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)]
PARAMETERS: list[tuple[int, ...]] = [(VOCAB, HIDDEN), *(_LAYER * LAYERS), (HIDDEN,), (VOCAB, HIDDEN)]


# --- 1. the mesh ------------------------------------------------------------------------------

def _torch_mesh(world: int) -> None:
    """What build_mesh did before: init_device_mesh, every dim given the job's timeout but
    the one over the whole world, which is the default group (made with that timeout)."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.mesh import MESH_DIMS, _timeout_options

    shape = (1, world, 1, 1)
    init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS,
                     backend_override={d: _timeout_options("cpu", TIMEOUT)
                                       for d, n in zip(MESH_DIMS, shape, strict=True)
                                       if n != world})


def _mesh_rank(rank: int, world: int, port: int, runs: int, out: str) -> None:
    from parallel.layout import Layout
    from parallel.mesh import build_mesh

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    arms = {"build_mesh": lambda: build_mesh(Layout(dp=world), "cpu", TIMEOUT),
            "init_device_mesh": lambda: _torch_mesh(world)}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    for run in range(runs + 1):  # the first round pays the process's first calls: not timed
        for arm, build in arms.items():
            dist.barrier()
            started = time.perf_counter()
            build()
            if run:
                seconds[arm].append(time.perf_counter() - started)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


def mesh_seconds(world: int, runs: int) -> dict[str, float]:
    """Median seconds of each arm on rank 0 of a gloo world of `world` ranks."""
    from daemon.procutil import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "mesh.json")
        mp.start_processes(_mesh_rank, args=(world, free_port(), runs, out), nprocs=world,
                           start_method="spawn")
        seconds = json.loads(Path(out).read_text())
    return {arm: statistics.median(s) for arm, s in seconds.items()}


# --- 2. the metadata --------------------------------------------------------------------------

def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP's dim-0 shard of `n` rows on `rank` of `world`: [lo, hi)."""
    per = math.ceil(n / world)
    lo = min(rank * per, n)
    return lo, min(lo + per, n)


def _chunk(shape: tuple[int, ...], world: int, rank: int) -> ChunkStorageMetadata:
    lo, hi = _rows(shape[0], world, rank)
    return ChunkStorageMetadata(offsets=torch.Size([lo, *[0] * (len(shape) - 1)]),
                                sizes=torch.Size([hi - lo, *shape[1:]]))


def saved_metadata(world: int, shapes: list[tuple[int, ...]]) -> Metadata:
    """The `.metadata` of a snapshot of `shapes` saved by `world` FSDP ranks."""
    tensors, items = {}, {}
    for i, shape in enumerate(shapes):
        fqn = f"state.t{i}"
        chunks = [_chunk(shape, world, r) for r in range(world)]
        tensors[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                             torch.Size(shape), chunks)
        for r, c in enumerate(chunks):
            items[MetadataIndex(fqn, c.offsets, 0)] = SnapshotItem(
                f"__{r}_0.distcp", 0, math.prod(c.sizes) * 4, "float32", tuple(c.sizes))
    return Metadata(state_dict_metadata=tensors, storage_data=items)


@dataclass(frozen=True)
class Plan:
    """One restoring rank's plan: what it reads."""

    read_items: int
    read_elements: int  # elements the plan reads, all tensors together


@dataclass(frozen=True)
class PickleCosts:
    """DCP's pickled `Metadata`, as a snapshot's `.metadata` was."""

    size_bytes: int
    write_s: float  # pickle it and check that the allow-list takes it
    unpickle_s: float
    check_s: float
    plan_s: float
    plan: Plan


@dataclass(frozen=True)
class IndexCosts:
    """The index a snapshot's `.metadata` is now."""

    size_bytes: int
    write_s: float  # build it from DCP's Metadata, serialise it and parse it back
    parse_s: float  # parse and check it, and check its items against the files' sizes
    narrow_s: float  # the skeleton and each tensor's overlapping chunks
    plan_s: float
    plan: Plan


def _local(world: int, shapes: list[tuple[int, ...]]) -> list[ChunkStorageMetadata]:
    """The chunks a middle rank of `world - 1` restores of each tensor."""
    new = max(1, world - 1)
    return [_chunk(shape, new, new // 2) for shape in shapes]


def _plan(metadata: Metadata, local: list[ChunkStorageMetadata]) -> Plan:
    reads = [create_read_items_for_chunk_list(f"state.t{i}",
                                              metadata.state_dict_metadata[f"state.t{i}"],
                                              [chunk])
             for i, chunk in enumerate(local)]
    return Plan(sum(len(r) for r in reads),
                sum(math.prod(item.lengths) for r in reads for item in r))


def pickle_costs(world: int, shapes: list[tuple[int, ...]] | None = None) -> PickleCosts:
    """One restoring rank's work on DCP's pickled metadata of `world` ranks, on `world - 1`."""
    shapes = shapes or PARAMETERS * 3
    saved = saved_metadata(world, shapes)
    gc.collect()  # the simulation's own garbage, not the costs measured
    started = time.perf_counter()
    blob = pickle.dumps(saved)
    load_metadata(blob)
    written = time.perf_counter()
    metadata = load_metadata(blob)
    unpickled = time.perf_counter()
    if not all(isinstance(v, SnapshotItem) and isinstance(v.file, str)
               and all(isinstance(n, int) and n >= 0 for n in (v.offset, v.length))
               for v in (metadata.storage_data or {}).values()):
        raise AssertionError("the simulated storage items do not check")
    checked = time.perf_counter()
    plan = _plan(metadata, _local(world, shapes))
    return PickleCosts(len(blob), written - started, unpickled - written, checked - unpickled,
                       time.perf_counter() - checked, plan)


def index_costs(world: int, shapes: list[tuple[int, ...]] | None = None) -> IndexCosts:
    """The same with the index a snapshot's `.metadata` is now."""
    shapes = shapes or PARAMETERS * 3
    saved = saved_metadata(world, shapes)
    gc.collect()  # the simulation's own garbage, not the costs measured
    started = time.perf_counter()
    blob = SnapshotIndex.of_metadata(saved).to_bytes()
    SnapshotIndex.parse(blob, "bench")
    written = time.perf_counter()
    index = SnapshotIndex.parse(blob, "bench")
    index.check_files({name: 1 << 40 for name in index.files}, "bench")
    parsed = time.perf_counter()
    metadata = index.skeleton()
    for i, chunk in enumerate(_local(world, shapes)):
        fqn = f"state.t{i}"
        picked = index.narrow(fqn, [chunk])
        metadata.state_dict_metadata[fqn].chunks = [c for c, _, _ in picked]
        metadata.storage_data.update((key, item) for _, key, item in picked)
    narrowed = time.perf_counter()
    plan = _plan(metadata, _local(world, shapes))
    return IndexCosts(len(blob), written - started, parsed - written, narrowed - parsed,
                      time.perf_counter() - narrowed, plan)


# --- the tables -------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.restore_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh-worlds", default="2,4,8,16")
    p.add_argument("--worlds", default="8,64,256,1024")
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args(argv)
    mesh_worlds = [int(w) for w in a.mesh_worlds.split(",") if w]
    worlds = [int(w) for w in a.worlds.split(",") if w]

    rows = []
    for world in mesh_worlds:
        s = mesh_seconds(world, a.runs)
        rows.append([str(world), f"{1e3 * s['build_mesh']:.1f}",
                     f"{1e3 * s['init_device_mesh']:.1f}",
                     f"{s['init_device_mesh'] / s['build_mesh']:.1f}x"])
    if rows:
        print("the mesh of a data-parallel job (dp = world), gloo, rank 0, ms "
              f"(median of {a.runs})")
        print(_table(["ranks", "build_mesh", "init_device_mesh", "ratio"], rows), flush=True)

    rows = []
    for world in worlds:
        before = [pickle_costs(world) for _ in range(a.runs)]
        now = [index_costs(world) for _ in range(a.runs)]
        local = sum(math.prod(c.sizes) for c in _local(world, PARAMETERS * 3))
        for plan in (before[0].plan, now[0].plan):
            if plan.read_elements != local:
                raise AssertionError(f"a plan reads {plan.read_elements} elements for {local}")
        if before[0].plan != now[0].plan:
            raise AssertionError(f"the index's plan {now[0].plan} is not DCP's {before[0].plan}")

        def ms(runs: list, field: str) -> str:
            return f"{1e3 * statistics.median(getattr(r, field) for r in runs):.0f}"

        rows.append([f"{world} -> {max(1, world - 1)}", f"{before[0].size_bytes / 1e6:.1f}",
                     ms(before, "write_s"), ms(before, "unpickle_s"), ms(before, "check_s"),
                     ms(before, "plan_s"), f"{now[0].size_bytes / 1e6:.1f}",
                     ms(now, "write_s"), ms(now, "parse_s"), ms(now, "narrow_s"),
                     ms(now, "plan_s"), str(now[0].plan.read_items)])
    if rows:
        print(f"\na snapshot's .metadata on one restoring rank, a 1B Llama's {len(PARAMETERS)} "
              f"parameters and 2 AdamW moments, FSDP; ms (median of {a.runs}): DCP's pickle "
              "(before) and the index (now)")
        print(_table(["ranks saved -> restored", "pickle MB", "write", "unpickle", "check items",
                      "DCP plan", "index MB", "write", "parse", "narrow", "DCP plan",
                      "read items"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
