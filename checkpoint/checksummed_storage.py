"""DCP storage that checksums what each rank writes and verifies what each rank reads.

Writing: `ChecksummingWriter` wraps every file stream DCP opens, so each rank checksums its own
`__<rank>_<n>.distcp` files as the bytes go by (no second read), and the coordinator its
`.metadata`. Each rank's entries ride to the coordinator inside its write results, which DCP
already gathers for `finish`; `finish` takes them out before DCP builds its metadata, so the
`.metadata` file is what plain DCP would write. After the save, `files` on the coordinator lists
every file of the checkpoint for the manifest, and nobody re-reads a byte.

Every file is flushed, then fsynced, as it is closed (DCP's own `sync_files` fsyncs `.metadata`
before flushing it, when its bytes may still sit in the file object's buffer), and each rank
fsyncs the step directory once its files are in it; the coordinator again after DCP renames
`.metadata` into place. So when the save returns, everything the manifest will list is on disk.

Reading: `VerifyingReader` knows, once DCP has planned the load, exactly which byte ranges this
rank will read. It checks those files' sizes and the checksums of the blocks the ranges touch,
and loads its byte items through torch's restricted unpickler, then agrees with every other rank
(one all_gather on the checkpoint group) before reading any tensor. So a mismatch anywhere fails
the load on every rank with the same error, and no rank has copied a byte of a corrupt checkpoint
into its state. DCP's `.metadata` is unpickled by an allow-list (checkpoint/safe_unpickle.py):
nothing a checkpoint holds is run.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from os import PathLike
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint.checksum import CURRENT, BlockHasher, Scheme
from checkpoint.manifest import (
    TMP_SUFFIX,
    CheckpointInvalid,
    FileEntry,
    Manifest,
    fsync_dir,
    verify_reads,
)
from checkpoint.safe_unpickle import SafeLoadPlanner, UnsafePickle, load_metadata, load_torch_value

METADATA_NAME = ".metadata"  # DCP's name for it


def read_dcp_metadata(ckpt_dir: Path) -> Metadata:
    """DCP's `.metadata` of `ckpt_dir`, unpickled by the allow-list; CheckpointInvalid names the
    file when it is unreadable, refused, or not a file system checkpoint's."""
    label = f"{ckpt_dir.name}/{METADATA_NAME}"
    try:
        data = (ckpt_dir / METADATA_NAME).read_bytes()
    except OSError as e:
        raise CheckpointInvalid(f"{label}: unreadable ({e.strerror})") from e
    try:
        metadata = load_metadata(data)
    except UnsafePickle as e:
        raise CheckpointInvalid(f"{label}: {e}") from None
    if not isinstance(metadata.storage_data, dict) or not all(
            isinstance(v, _StorageInfo) for v in metadata.storage_data.values()):
        raise CheckpointInvalid(f"{label}: its storage data is not a file system checkpoint's")
    return metadata


class _ChecksummingFile:
    """A write-only file that feeds every byte written to a hasher on the way to disk."""

    def __init__(self, raw: Any, hasher: BlockHasher) -> None:
        self._raw, self._hasher = raw, hasher

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        self._hasher.update(memoryview(data).cast("B")[:written])
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        """Flush, fsync, close: the bytes are on disk once the file is closed."""
        if self._raw.closed:
            return
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()


class _ChecksummingFileSystem(FileSystem):
    def __init__(self, root: Path, scheme: Scheme) -> None:
        super().__init__()
        self.root, self.scheme = root, scheme
        self._lock = threading.Lock()  # DCP may write with several threads (thread_count)
        self._written: list[FileEntry] = []

    @contextmanager
    def create_stream(self, path: str | PathLike, mode: str) -> Generator[Any, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        hasher = BlockHasher(self.scheme)
        with super().create_stream(path, mode) as raw:
            stream = _ChecksummingFile(raw, hasher)
            yield stream
            stream.close()  # DCP closes a shard itself, but `.metadata` only by leaving this
        rel = Path(path).relative_to(self.root).as_posix()
        with self._lock:
            self._written.append(FileEntry(rel, hasher.size, hasher.digests()))

    def take_written(self) -> list[FileEntry]:
        with self._lock:
            written, self._written = self._written, []
        return written


class ChecksummingWriter(FileSystemWriter):
    """A FileSystemWriter whose ranks checksum what they write, and fsync it (after flushing it:
    see the module docstring) and the directory holding it."""

    def __init__(self, path: str | PathLike, *, scheme: Scheme = CURRENT) -> None:
        # Our file system fsyncs every file it closes; DCP's own fsync would come too early.
        super().__init__(path, sync_files=False)
        self.scheme = scheme
        self.fs = _ChecksummingFileSystem(Path(path), scheme)
        self.mine: tuple[FileEntry, ...] = ()  # the files this rank wrote
        self.files: tuple[FileEntry, ...] | None = None  # coordinator, after finish: all of them

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()  # FileSystemWriter writes in-line
        self.mine = tuple(self.fs.take_written())
        fsync_dir(Path(self.path))  # this rank's new files' names (on a node-local root, only here)
        done: Future[list[Any]] = Future()
        done.set_result([*results, *self.mine])
        return done  # type: ignore[return-value]

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        reported = [r for per_rank in results for r in per_rank if isinstance(r, FileEntry)]
        plain = [[r for r in per_rank if not isinstance(r, FileEntry)] for per_rank in results]
        super().finish(metadata, plain)
        fsync_dir(Path(self.path))  # the rename of `.metadata` into place
        # A checkpoint whose `.metadata` a restore would refuse must not count (a state holding
        # some class the allow-list lacks): fail the save, loudly, instead.
        read_dcp_metadata(Path(self.path))
        # DCP writes `.metadata` under a temporary name and renames it; file it under the final one.
        meta = [
            FileEntry(e.path.removesuffix(TMP_SUFFIX), e.size, e.digests)
            for e in self.fs.take_written()
            if e.path.endswith(TMP_SUFFIX)
        ]
        self.files = tuple(sorted(reported + meta, key=lambda e: e.path))


class VerifyingReader(FileSystemReader):
    """A FileSystemReader whose ranks verify the blocks they will read before reading any."""

    def __init__(
        self, path: str | PathLike, manifest: Manifest, *, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__(path)
        self.ckpt_dir, self.manifest, self.group = Path(path), manifest, group
        self.checked: dict[str, tuple[int, ...]] = {}  # file → blocks this rank verified
        self.invalid: CheckpointInvalid | None = None  # set alike on every rank
        self.invalid_ranks: tuple[int, ...] = ()  # the ranks that found a problem
        self.refused: CheckpointInvalid | None = None  # this rank's `.metadata` would not load

    def read_metadata(self, *args: Any) -> Metadata:
        # No **kwargs: DCP then never falls back to a rank's own `__<rank>.metadata`, which a
        # checkpoint of ours does not have (and the manifest does not list).
        try:
            metadata = read_dcp_metadata(self.ckpt_dir)
        except CheckpointInvalid as e:
            self.refused = e
            raise
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def agree_invalid(self) -> bool:
        """After a failed load, on every rank alike (a collective): whether some rank found the
        checkpoint invalid, with `invalid` and `invalid_ranks` then set as `read_data` sets them."""
        if self.invalid is not None:  # read_data's agreement: every rank has it
            return True
        found = [str(self.refused) if self.refused else ""]
        if dist.is_initialized():
            found = [""] * dist.get_world_size(self.group)
            dist.all_gather_object(found, str(self.refused) if self.refused else "",
                                   group=self.group)
        self._agreed([(rank, p) for rank, p in enumerate(found) if p])
        return self.invalid is not None

    def _agreed(self, found: list[tuple[int, str]]) -> None:
        if not found:
            return
        first = found[0][1]
        ranks = ", ".join(str(rank) for rank, p in found if p == first)
        others = sum(p != first for _, p in found)
        more = f"; {others} other problem(s) on other ranks" if others else ""
        self.invalid = CheckpointInvalid(f"{first} (found by rank {ranks}{more})")
        self.invalid_ranks = tuple(rank for rank, _ in found)

    def _byte_values(self, plan: LoadPlan) -> dict[MetadataIndex, Any]:
        """This rank's byte items, read and loaded by torch's restricted unpickler."""
        values: dict[MetadataIndex, Any] = {}
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                continue
            info = self.storage_data[item.storage_index]
            label = f"{self.ckpt_dir.name}/{info.relative_path}: byte item {item.storage_index.fqn}"
            if info.transform_descriptors:
                raise CheckpointInvalid(f"{label} is stored through {info.transform_descriptors}, "
                                        "which this reader does not undo")
            with open(self.ckpt_dir / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            try:
                values[item.storage_index] = load_torch_value(data)
            except UnsafePickle as e:
                raise CheckpointInvalid(f"{label} {e}") from None
        return values

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        reads: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            reads.setdefault(info.relative_path, []).append((info.offset, info.length))
        problem, crashed = "", ""
        values: dict[MetadataIndex, Any] = {}
        try:
            self.checked = verify_reads(self.ckpt_dir, self.manifest, reads)
            values = self._byte_values(plan)
        except CheckpointInvalid as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - reported to every rank below, then raised
            crashed = f"{type(e).__name__}: {e}"
        # Every rank reaches this collective, whatever happened above, so all of them learn the
        # outcome together and fall back (or fail) together instead of waiting out a timeout.
        outcomes = [(problem, crashed)]
        if dist.is_initialized():
            outcomes = [("", "")] * dist.get_world_size(self.group)
            dist.all_gather_object(outcomes, (problem, crashed), group=self.group)
        for rank, (_, error) in enumerate(outcomes):
            if error:
                raise RuntimeError(f"verifying {self.ckpt_dir.name} failed on rank {rank}: {error}")
        self._agreed([(rank, p) for rank, (p, _) in enumerate(outcomes) if p])
        if self.invalid is not None:
            raise self.invalid
        tensors = dataclasses.replace(
            plan, items=[i for i in plan.items if i.type != LoadItemType.BYTE_IO])
        done = super().read_data(tensors, planner)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                _deliver(planner, item, values[item.storage_index])
        return done


def _deliver(planner: LoadPlanner, item: Any, value: Any) -> None:
    """A byte item's (safely loaded) value to `planner`: as is to ours, else in the torch.save
    form DCP's planners expect (our own bytes now, so their torch.load runs nothing foreign)."""
    if isinstance(planner, SafeLoadPlanner):
        planner.load_value(item, value)
        return
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    planner.load_bytes(item, buffer)
