"""Per-step snapshots: a DCP `StorageWriter` into POSIX shared memory (docs/snapshots.md).

Each rank writes its shard straight into a shared-memory file as raw bytes (no pickling of
tensors). A generation's first snapshot is a DCP save (planning, collectives, the copy and the
checksums all on the step); every later one is a rewrite of the same layout, of which only the
copy into a host buffer holds the step (`stage_rewrite`, checkpoint/snapshot_staging.py). The
files outlive the worker: the node's agent, not the worker, frees them.

The coordinator writes `.metadata` (not DCP's pickle: an index of where every item lives,
checkpoint/snapshot_index.py) and then the manifest, last: a snapshot whose writer died at any
earlier point has no manifest and is never complete.

A restore parses `.metadata` without unpickling anything and unpickles the byte items by an
allow-list (checkpoint/safe_unpickle.py). A full save checks that what it wrote passes both,
so a state holding anything else fails its snapshot loudly here rather than every restore of
it later.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from checkpoint import snapshot_fastpath as fastpath
from checkpoint.safe_unpickle import UnsafePickle, load_value
from checkpoint.snapshot_format import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    METADATA_NAME,
    FileEntry,
    SnapshotItem,
    SnapshotManifest,
    chunk_checksums,
    crc32c_update,
    create_private_file,
    private_dirs,
    pwritev_all,
    record_bytes,
    record_name,
    shard_name,
    slot,
    step_dir,
    write_atomically,
)
from checkpoint.snapshot_index import SnapshotIndex
from checkpoint.snapshot_staging import HostStaging, StagedShard
from checkpoint.state import TrainState

# The index under which a rank's write results carry its FileEntry to the coordinator:
# DCP hands `finish` every rank's results and nothing else, and `finish` takes this one out
# before the rest becomes `.metadata`.
_FILE_FQN = "__ultrascale_snapshot_file__"


@dataclasses.dataclass(frozen=True)
class Template:
    """One rank's shard layout, fixed by a full save: every write item at its offset."""

    rank: int
    items: tuple[tuple[Any, int, int], ...]  # (WriteItem, offset, length)
    size: int


@dataclasses.dataclass(frozen=True)
class CoordinatorTemplate:
    """The coordinator's `.metadata` and manifest entries, the same for every snapshot of a
    generation (the storage layout does not change)."""

    metadata: bytes
    shards: tuple[FileEntry, ...]  # chunks None: each rank's record holds them
    world_size: int

    def write(self, directory: Path, step: int, consumed_samples: int, layout: dict[str, Any],
              rank: int) -> None:
        write_atomically(directory / METADATA_NAME, self.metadata)
        manifest = SnapshotManifest(
            step=step,
            consumed_samples=consumed_samples,
            world_size=self.world_size,
            layout=layout,
            files=(*self.shards, FileEntry(METADATA_NAME, rank, len(self.metadata),
                                           chunk_checksums(self.metadata))),
        )
        write_atomically(directory / MANIFEST_NAME, manifest.to_bytes())


@dataclasses.dataclass(frozen=True)
class _Payload:
    item: Any  # WriteItem
    data: torch.Tensor | bytes
    offset: int
    length: int


def tensor_bytes(data: torch.Tensor) -> memoryview:
    """The bytes of `data` as the shard stores them: its host memory itself when it is a
    contiguous CPU tensor, else a contiguous host copy (for a device tensor, the step's
    device-to-host copy)."""
    dense = data.detach()
    if dense.device.type != "cpu":
        dense = dense.cpu()
    return memoryview(dense.contiguous().reshape(-1).view(torch.uint8).numpy())


def _bytes_of(p: _Payload) -> memoryview:
    """A tensor item's bytes."""
    assert isinstance(p.data, torch.Tensor)
    return tensor_bytes(p.data) if p.length else memoryview(b"")


def chunk_checksums_of(buffers: list[memoryview], chunk_bytes: int = CHUNK_BYTES
                       ) -> tuple[int, ...]:
    """The chunk checksums of the concatenation of `buffers`, without concatenating them."""
    chunks: list[int] = []
    crc, filled = 0, 0
    for buffer in buffers:
        while len(buffer):
            take = min(len(buffer), chunk_bytes - filled)
            crc = crc32c_update(buffer[:take], crc)
            filled += take
            buffer = buffer[take:]
            if filled == chunk_bytes:
                chunks.append(crc)
                crc, filled = 0, 0
    if filled:
        chunks.append(crc)
    return tuple(chunks)


class SnapshotWriter(StorageWriter):
    def __init__(
        self, root: Path, *, step: int, consumed_samples: int, layout: dict[str, Any]
    ) -> None:
        super().__init__()
        self.directory = step_dir(root, step)
        self.step = step
        self.consumed_samples = consumed_samples
        self.layout = dict(layout)
        self.rank = 0
        self.world_size = 1
        # Seconds this rank spent copying into shared memory and checksumming it: what the
        # step pays beyond DCP's planning and collectives.
        self.copy_seconds = 0.0
        self.checksum_seconds = 0.0
        # Where this rank's items went, and (coordinator) the metadata and manifest: what a
        # later snapshot of the same generation rewrites in place (`rewrite_snapshot`).
        self.template: Template | None = None
        self.coordinator: CoordinatorTemplate | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            raise ValueError("SnapshotWriter names its own directory; pass checkpoint_id=None")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.make_directory()
        return plan

    def make_directory(self) -> None:
        """The step's directory, private, in a root that must be private too (the agent made it;
        one another user could change is refused: UnsafeDirectory)."""
        private_dirs(self.directory.parent, self.directory)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        started = time.perf_counter()
        payloads, offset = [], 0
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = slot(_restorable(_pickled(planner, item, data), item.index.fqn))
                payloads.append(_Payload(item, raw, offset, len(raw)))
                offset += len(raw)
            else:
                assert isinstance(data, torch.Tensor)
                length = data.numel() * data.element_size()
                payloads.append(_Payload(item, data, offset, length))
                offset += length
        name = shard_name(self.rank)
        entry = self._write_shard(payloads, offset, started)
        self.template = Template(self.rank, tuple((p.item, p.offset, p.length) for p in payloads),
                                 offset)
        results = [
            WriteResult(
                index=p.item.index,
                size_in_bytes=p.length,
                storage_data=SnapshotItem(
                    file=name,
                    offset=p.offset,
                    length=p.length,
                    dtype=None if isinstance(p.data, bytes) else str(p.data.dtype).removeprefix("torch."),
                    shape=() if isinstance(p.data, bytes) else tuple(p.data.shape),
                ),
            )
            for p in payloads
        ]
        results.append(WriteResult(MetadataIndex(_FILE_FQN, index=self.rank), offset, entry))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_shard(self, payloads: list[_Payload], size: int, started: float) -> FileEntry:
        """The rank's shard file, then its record (chunk checksums): a shard is whole once its
        record exists, so the node's agent can validate and stream it before any manifest."""
        name = shard_name(self.rank)
        # O_EXCL: two writers of one rank and step would interleave; fail loudly instead.
        fd = create_private_file(self.directory / name)
        try:
            os.ftruncate(fd, size)
            chunks = self._fill(fd, size, payloads)
        finally:
            os.close(fd)
        self.copy_seconds = time.perf_counter() - started - self.checksum_seconds
        entry = FileEntry(path=name, rank=self.rank, size=size, chunks=chunks)
        write_atomically(self.directory / record_name(self.rank), record_bytes(self.step, entry))
        return entry

    def _fill(self, fd: int, size: int, payloads: list[_Payload]) -> tuple[int, ...]:
        buffers: list[memoryview] = []
        small: list[bytes] = []  # adjacent byte items, written as one buffer
        end = 0
        for p in payloads:
            if p.offset != end:
                raise ValueError(f"snapshot shard {shard_name(self.rank)}: item at offset "
                                 f"{p.offset}, expected {end}: items must be back to back")
            if isinstance(p.data, bytes):
                small.append(p.data)
            else:
                if small:
                    buffers.append(memoryview(b"".join(small)))
                    small = []
                buffers.append(_bytes_of(p))
            end += p.length
        if small:
            buffers.append(memoryview(b"".join(small)))
        if end != size:
            raise ValueError(f"snapshot shard {shard_name(self.rank)}: items cover {end} of "
                             f"its {size} bytes")
        # One pwritev(2) for the whole shard, straight from the tensors' memory: a kernel
        # copy into tmpfs pages, no system call per item. (Copying into an mmap of the file
        # is slower: it faults every page in.)
        pwritev_all(fd, buffers)
        started = time.perf_counter()
        chunks = chunk_checksums_of(buffers)
        self.checksum_seconds = time.perf_counter() - started
        return chunks

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: list[FileEntry] = []
        storage: dict[MetadataIndex, SnapshotItem] = {}
        for rank_results in results:
            for result in rank_results:
                if isinstance(result.storage_data, FileEntry):
                    files.append(result.storage_data)
                else:
                    storage[result.index] = result.storage_data
        metadata.storage_data = storage
        # Not DCP's pickle: an index a restoring rank reads without an object per saved chunk
        # (checkpoint/snapshot_index.py).
        try:
            blob = SnapshotIndex.of_metadata(metadata).to_bytes()
            SnapshotIndex.parse(blob, METADATA_NAME)
        except ValueError as exc:  # SnapshotInvalid among them
            raise ValueError(f"snapshot step {self.step}: {METADATA_NAME} would not restore: "
                             f"{exc}") from None
        # Shard checksums stay in each rank's record: a later snapshot of the generation, which
        # no collective gathers, writes the same manifest with only the step changed.
        shards = tuple(dataclasses.replace(f, chunks=None) for f in sorted(files,
                                                                           key=lambda f: f.rank))
        self.coordinator = CoordinatorTemplate(blob, shards, len(results))
        self.coordinator.write(self.directory, self.step, self.consumed_samples, self.layout,
                               self.rank)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


def _pickled(planner: SavePlanner, item: Any, resolved: Any) -> bytes:
    """A byte item as a plain pickle of its value: DCP's own form (a torch.save zip per item)
    builds a zip archive for each, and an optimizer has a dozen per parameter."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is not None:
        return pickle.dumps(lookup(item.index))
    assert isinstance(resolved, io.BytesIO)
    return pickle.dumps(torch.load(io.BytesIO(resolved.getvalue()), weights_only=True))


def _restorable(raw: bytes, fqn: str) -> bytes:
    """`raw` once a restore's unpickler takes it (ValueError: it would refuse it)."""
    try:
        load_value(raw)
    except UnsafePickle as exc:
        raise ValueError(f"snapshot byte item {fqn} would not restore: {exc}") from None
    return raw


def save_snapshot(
    state: TrainState,
    root: Path,
    *,
    layout: dict[str, Any],
    process_group: dist.ProcessGroup | None = None,
) -> SnapshotWriter:
    """Snapshot `state` at its current step into `root`; returns the writer (for its timings)."""
    writer = SnapshotWriter(
        root,
        step=state.progress.step,
        consumed_samples=state.progress.consumed_samples,
        layout=layout,
    )
    dcp.save({"state": state}, storage_writer=writer, process_group=process_group)
    return writer


def rewrite_snapshot(*args: Any, **kwargs: Any) -> StagedShard:
    """`stage_rewrite` (same arguments) and then its write, in the caller's thread
    (trainer.snapshots runs the write on a thread of its own). Returns the written shard: its
    fast path (`resolved`) and timings."""
    staged = stage_rewrite(*args, **kwargs)
    staged.write()
    return staged


def staging_for(state: TrainState, template: Template) -> HostStaging:
    """The host buffer every rewrite of `template`'s generation copies `state` into."""
    tensor_items = [i for i, (item, _, length) in enumerate(template.items)
                    if item.type != WriteItemType.BYTE_IO and length]
    return HostStaging(template.items, template.size, tensor_items, state_device(state))


def state_device(state: TrainState) -> torch.device:
    """Where the state's tensors live (its first parameter's local shard)."""
    for parameter in state.model.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        return local.device
    return torch.device("cpu")


def stage_rewrite(
    state: TrainState,
    root: Path,
    template: Template,
    coordinator: CoordinatorTemplate | None,
    *,
    layout: dict[str, Any],
    resolved: fastpath.ResolvedTemplate | None = None,
    staging: HostStaging | None = None,
) -> StagedShard:
    """The part of a rewrite that holds the step (checkpoint/snapshot_staging.py): every item
    resolved from the current state as the full save of the same generation fixed them, the
    tensors copied into `staging` (made here when None), the byte items' values captured. No
    planning and no collective. Its `write()` does the rest.

    With `resolved` (the previous rewrite's) and while it is still valid, the items are not
    looked up again (checkpoint/snapshot_fastpath.py); the result's `resolved` is what the
    next rewrite may use (None: no fast path for this state).
    """
    started = time.perf_counter()
    if staging is None:
        staging = staging_for(state, template)
    if resolved is not None and resolved.usable():
        values = resolved.values()
        staging.copy_resolved(resolved)
    else:
        planner = DefaultSavePlanner()
        planner.set_up_planner({"state": state.state_dict()}, None, coordinator is not None)
        sources = [(planner.lookup_object(item.index), True)
                   if item.type == WriteItemType.BYTE_IO else (planner.resolve_data(item), False)
                   for item, _, _ in template.items]
        resolved = fastpath.build(state, planner.state_dict, [
            (item, data, is_bytes, length) for (item, _, length), (data, is_bytes)
            in zip(template.items, sources, strict=True)])
        values = fastpath.ByteValues.of(
            {index: data for index, (data, is_bytes) in enumerate(sources) if is_bytes})
        staging.copy([fastpath.tensor_as_bytes(data) for (data, is_bytes), (_, _, length)
                      in zip(sources, template.items, strict=True) if not is_bytes and length])
    step, consumed = state.progress.step, state.progress.consumed_samples

    def finish_coordinator(directory: Path) -> None:
        assert coordinator is not None
        coordinator.write(directory, step, consumed, layout, template.rank)

    return StagedShard(
        root=root, rank=template.rank, step=step, values=values, staging=staging,
        resolved=resolved, finish_coordinator=finish_coordinator if coordinator else None,
        stage_seconds=time.perf_counter() - started)
