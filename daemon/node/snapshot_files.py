"""Files of the in-memory snapshots as the agent handles them: a peer's incoming file, reading
one in pieces, and small stat helpers (daemon/node/snapshot_keeper.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from checkpoint.snapshot_format import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    METADATA_NAME,
    FileEntry,
    SnapshotInvalid,
    SnapshotManifest,
    parse_step_dir,
    private_dirs,
    shard_rank,
    step_dir,
    verify_span,
)

log = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20  # one gRPC message of file data (gRPC's default limit is 4 MiB)


@dataclass(frozen=True)
class Incoming:
    """The header of a file a peer sends (the first message of a file on SnapshotPeer.Replicate)."""

    step: int
    file: str
    size: int
    chunks: tuple[int, ...]
    rank: int


class ParsedFiles:
    """`parse(bytes of path)`, cached while the file's inode, size and mtime stay the same
    (files are replaced by rename, never rewritten in place): the keeper looks at every held
    file every poll, and parsing them all again cost an agent 10% of a core. Paths are plain
    strings: pathlib's joins and hashes were a tenth of what an agent spent on snapshots."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[tuple[int, int, int], object]] = {}

    def get(self, path: str, parse: Callable[[bytes], object]) -> object | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._cache.pop(path, None)
            return None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._cache.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            with open(path, "rb") as f:
                value = parse(f.read())
        except (OSError, ValueError, SnapshotInvalid):
            value = None
        self._cache[path] = (key, value)
        return value

    def keep_only(self, directories: set[str]) -> None:
        """Forget the files outside `directories` (freed steps)."""
        self._cache = {p: v for p, v in self._cache.items()
                       if os.path.dirname(p) in directories}


def verify_incoming(header: Incoming, data: bytes) -> SnapshotManifest | None:
    """Raises SnapshotInvalid unless `data` is what `header` says: a snapshot file of its size
    whose every chunk matches its checksum (a manifest: its own checksum, and its step). Returns
    the manifest, parsed, when it is one."""
    where = f"copy of snapshot step {header.step}: {header.file} from a peer"
    if shard_rank(header.file) is None and header.file not in (METADATA_NAME, MANIFEST_NAME):
        raise SnapshotInvalid(f"{where}: not a snapshot file name")
    if len(data) != header.size:
        raise SnapshotInvalid(f"{where} is truncated: {len(data)} of {header.size} bytes")
    if header.file == MANIFEST_NAME:
        return parse_step_manifest(data, header.step)
    if len(header.chunks) != -(-header.size // CHUNK_BYTES):
        raise SnapshotInvalid(f"{where}: {len(header.chunks)} chunk checksums for "
                              f"{header.size} bytes")
    verify_span(FileEntry(header.file, header.rank, header.size, header.chunks), 0, header.size,
                data, where)
    return None


def parse_step_manifest(raw: bytes, step: int) -> SnapshotManifest:
    manifest = SnapshotManifest.parse(raw, f"snapshot step {step}: {MANIFEST_NAME}")
    if manifest.step != step:
        raise SnapshotInvalid(f"snapshot step {step}: {MANIFEST_NAME} is of step {manifest.step}")
    return manifest


def ensure_metadata(root: Path, manifest: SnapshotManifest,
                    held: Callable[[str, int], SnapshotManifest | None]) -> None:
    """Before a peer's `manifest` is kept: its step's `.metadata` must be here. The metadata of a
    generation is the same for each of its steps, so a copy held for another step with the
    manifest's size and checksums is linked in; with none, raises SnapshotInvalid (the sender
    then sends the metadata again, and the manifest after it). `held(directory, step)` is the
    manifest held in a step directory (None: none that parses)."""
    step, want = manifest.step, manifest.file(METADATA_NAME)
    directory = step_dir(root, step)
    if size_of(directory / METADATA_NAME) == want.size:
        return
    for other in sorted(root.glob("step_*"), reverse=True):
        held_step = parse_step_dir(other.name)
        source = other / METADATA_NAME
        other_manifest = held(str(other), held_step) if held_step is not None else None
        if other_manifest is None:
            continue
        entry = other_manifest.file(METADATA_NAME)
        if (entry.size, entry.chunks) == (want.size, want.chunks) \
                and size_of(source) == want.size:
            private_dirs(root, directory)
            temporary = directory / f".{METADATA_NAME}.link"
            temporary.unlink(missing_ok=True)
            os.link(source, temporary)  # files here are replaced by rename, never rewritten
            os.replace(temporary, directory / METADATA_NAME)
            return
    raise SnapshotInvalid(f"snapshot step {step}: {METADATA_NAME} is not here: send it before "
                          f"{MANIFEST_NAME}")


async def file_pieces(path: Path) -> AsyncIterator[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while True:
            piece = os.pread(fd, PIECE_BYTES, offset)
            if not piece:
                return
            offset += len(piece)
            yield piece
    finally:
        os.close(fd)


def size_of(path: str | os.PathLike[str]) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


def free_bytes(path: Path) -> int:
    """Free bytes of the filesystem holding `path` (its nearest existing ancestor)."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return 0


def check_room(root: Path, held: int, predicted: int) -> int:
    """Bytes `root` can hold for snapshots (free now plus the `held` bytes already there);
    warns when that is less than a plan's `predicted` host memory of a node's snapshots."""
    available = free_bytes(root) + held
    if predicted > available:
        log.warning("snapshots need about %.1f MB on this node (its shards and its buddy's, "
                    "3 steps) but %s has room for %.1f MB: snapshots will fail, and restores "
                    "fall back to the durable checkpoint", predicted / 1e6, root, available / 1e6)
    return available
