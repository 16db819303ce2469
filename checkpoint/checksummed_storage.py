"""DCP storage that checksums what each rank writes and verifies what each rank reads.

Writing: `ChecksummingWriter` wraps every file stream DCP opens, so each rank checksums its own
`__<rank>_<n>.distcp` files as the bytes go by (no second read), and the coordinator its
`.metadata`. Each rank's entries ride to the coordinator inside its write results, which DCP
already gathers for `finish`; `finish` takes them out before DCP builds its metadata, so the
`.metadata` file is what plain DCP would write. After the save, `files` on the coordinator lists
every file of the checkpoint for the manifest, and nobody re-reads a byte.

Reading: `VerifyingReader` knows, once DCP has planned the load, exactly which byte ranges this
rank will read. It checks those files' sizes and the checksums of the blocks the ranges touch,
then agrees with every other rank (one all_gather on the checkpoint group) before reading any
tensor. So a mismatch anywhere fails the load on every rank with the same error, and no rank has
copied a byte of a corrupt checkpoint into its state.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from contextlib import contextmanager
from os import PathLike
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpoint.checksum import CURRENT, BlockHasher, Scheme
from checkpoint.manifest import TMP_SUFFIX, CheckpointInvalid, FileEntry, Manifest, verify_reads


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
            yield _ChecksummingFile(raw, hasher)
        rel = Path(path).relative_to(self.root).as_posix()
        with self._lock:
            self._written.append(FileEntry(rel, hasher.size, hasher.digests()))

    def take_written(self) -> list[FileEntry]:
        with self._lock:
            written, self._written = self._written, []
        return written


class ChecksummingWriter(FileSystemWriter):
    """A FileSystemWriter (fsyncs every file) whose ranks checksum what they write."""

    def __init__(self, path: str | PathLike, *, scheme: Scheme = CURRENT) -> None:
        super().__init__(path, sync_files=True)
        self.scheme = scheme
        self.fs = _ChecksummingFileSystem(Path(path), scheme)
        self.mine: tuple[FileEntry, ...] = ()  # the files this rank wrote
        self.files: tuple[FileEntry, ...] | None = None  # coordinator, after finish: all of them

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()  # FileSystemWriter writes in-line
        self.mine = tuple(self.fs.take_written())
        done: Future[list[Any]] = Future()
        done.set_result([*results, *self.mine])
        return done  # type: ignore[return-value]

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        reported = [r for per_rank in results for r in per_rank if isinstance(r, FileEntry)]
        plain = [[r for r in per_rank if not isinstance(r, FileEntry)] for per_rank in results]
        super().finish(metadata, plain)
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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        reads: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            reads.setdefault(info.relative_path, []).append((info.offset, info.length))
        problem, crashed = "", ""
        try:
            self.checked = verify_reads(self.ckpt_dir, self.manifest, reads)
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
        found = [(rank, p) for rank, (p, _) in enumerate(outcomes) if p]
        if found:
            first = found[0][1]
            ranks = ", ".join(str(rank) for rank, p in found if p == first)
            others = sum(p != first for _, p in found)
            more = f"; {others} other problem(s) on other ranks" if others else ""
            self.invalid = CheckpointInvalid(f"{first} (found by rank {ranks}{more})")
            self.invalid_ranks = tuple(rank for rank, _ in found)
            raise self.invalid
        return super().read_data(plan, planner)
