"""Files of the in-memory snapshots as the agent handles them: a peer's incoming file, written
piece by piece and verified as it arrives, reading one in pieces, and small stat helpers
(daemon/node/snapshot_keeper.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
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
    crc32c_update,
    create_private_file,
    parse_step_dir,
    private_dirs,
    record_name,
    shard_rank,
    step_dir,
    write_atomically,
)

log = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20  # one gRPC message of file data (gRPC's default limit is 4 MiB)


@dataclass(frozen=True)
class Incoming:
    """The header of a file a peer sends (the first message of a file on SnapshotPeer.Replicate):
    the file, and who sends it of which history, signed (daemon/node/copy_admission.py)."""

    step: int
    file: str
    size: int
    chunks: tuple[int, ...]
    rank: int
    sender: str = ""
    spec_revision: int = 0
    generation: int = 0
    mac: bytes = b""

    @property
    def where(self) -> str:
        return f"copy of snapshot step {self.step}: {self.file} from {self.sender or 'a peer'}"


class IncomingFile:
    """A peer's copy being received: its data goes to a temporary file in its step directory as
    it arrives, each chunk checked against its checksum as soon as it is complete, so what the
    agent holds of it in memory is one piece whatever its size. `place()` renames it into
    place once whole; `discard()` (a refused, damaged or cut copy) leaves nothing, not even the
    step directory when the copy created it."""

    def __init__(self, directory: Path, header: Incoming) -> None:
        if shard_rank(header.file) is None and header.file not in (METADATA_NAME,
                                                                   MANIFEST_NAME):
            raise SnapshotInvalid(f"{header.where}: not a snapshot file name")
        if len(header.chunks) != -(-header.size // CHUNK_BYTES):
            raise SnapshotInvalid(f"{header.where}: {len(header.chunks)} chunk checksums for "
                                  f"{header.size} bytes")
        self.header, self.directory = header, directory
        self._made_directory = not directory.exists()
        private_dirs(directory.parent, directory)  # 0700, refused if another user controls it
        self.path = directory / f".{header.file}.{secrets.token_hex(6)}.part"
        # A name of our own, never followed if something is there already, readable by us only.
        self._fd: int | None = create_private_file(self.path)
        self.received = 0
        self._crc = 0  # the checksum of the current chunk's bytes so far

    def write(self, piece: bytes) -> None:
        """Append `piece`; raises SnapshotInvalid past the declared size or on a chunk whose
        checksum does not match."""
        header, view = self.header, memoryview(piece)
        if self.received + len(view) > header.size:
            raise SnapshotInvalid(f"{header.where}: more than its {header.size} bytes")
        assert self._fd is not None, "written after finish or discard"
        pos = 0
        while pos < len(view):
            take = min(len(view) - pos, CHUNK_BYTES - self.received % CHUNK_BYTES)
            part = view[pos:pos + take]
            self._crc = crc32c_update(part, self._crc)
            written = 0
            while written < take:  # a short write on a full tmpfs is retried, then ENOSPC
                written += os.write(self._fd, part[written:])
            self.received += take
            pos += take
            if self.received % CHUNK_BYTES == 0 or self.received == header.size:
                index = (self.received - 1) // CHUNK_BYTES
                if self._crc != header.chunks[index]:
                    raise SnapshotInvalid(f"{header.where}: checksum mismatch in chunk {index} "
                                          f"(bytes {index * CHUNK_BYTES}+)")
                self._crc = 0

    def place(self, held: Callable[[str, int], SnapshotManifest | None]) -> tuple[str, ...]:
        """Rename the whole, verified file into place (a manifest only once its step's
        `.metadata` is here, see `ensure_metadata`; a shard with its record beside it); returns
        the names placed. Raises SnapshotInvalid when it is short, or its step was freed
        meanwhile; the caller then discards it."""
        header, directory = self.header, self.directory
        if self.received != header.size:
            raise SnapshotInvalid(f"{header.where} is truncated: {self.received} of "
                                  f"{header.size} bytes")
        self._close()
        placed = [header.file]
        if header.file == MANIFEST_NAME:
            manifest = parse_step_manifest(self.path.read_bytes(), header.step)
            ensure_metadata(directory.parent, manifest, held)
            placed.append(METADATA_NAME)  # a peer's, maybe linked here from another step
        try:
            os.replace(self.path, directory / header.file)
            rank = shard_rank(header.file)
            if rank is not None:
                record = {"step": header.step, **FileEntry(header.file, rank, header.size,
                                                           header.chunks).to_json()}
                write_atomically(directory / record_name(rank), json.dumps(record).encode())
                placed.append(record_name(rank))
        except FileNotFoundError:
            raise SnapshotInvalid(f"{header.where}: its step was freed while it was "
                                  "received") from None
        return tuple(placed)

    def discard(self) -> None:
        self._close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._made_directory:
            with contextlib.suppress(OSError):  # not empty: something else arrived meanwhile
                self.directory.rmdir()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
