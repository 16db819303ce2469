"""The in-memory snapshot format: names, checksums, the manifest, and the private directories
and files that hold them (docs/snapshots.md).

A snapshot of step s is a directory `<root>/step_<8-digit s>/` in POSIX shared memory:

    rank_<5-digit r>.distcp   rank r's shard: raw tensor bytes and DCP's byte items, back to back
    rank_<5-digit r>.json     rank r's record of that file: size and chunk checksums
    .metadata                 DCP's Metadata (pickled), written by the coordinator
    manifest.json             written last, atomically: the step exists only once this does

Every file is checksummed per fixed-size chunk, so a reader of a byte range verifies just the
chunks it touches and a chunked stream to a peer carries ready-made checksums.

Training state is private: every directory of the store, from its base down, is this user's own
and not writable by anyone else (`private_dirs`), and every file is created new, mode 0600,
never through a name someone else could have placed (`create_private_file`).

Pure Python, no torch: the agent owns, serves and frees snapshots without importing it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

FORMAT = "ultrascale-snapshot"
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
METADATA_NAME = ".metadata"
# 4 MiB: big enough that per-chunk overhead is noise, small enough that a byte-range read
# verifies little beyond what it asked for.
CHUNK_BYTES = 4 << 20
# The most byte ranges one fetch call carries (worker to agent, agent to peer).
MAX_RANGES_PER_CALL = 4096
_PREAD_MAX = 0x7FFFF000  # the most one read(2) returns on Linux
_STEP_DIR = re.compile(r"step_(\d{8,})")
_DISCARDED_PREFIX = ".discarded-"


class SnapshotInvalid(ValueError):
    """A snapshot (or part of one) cannot be used; the message names the step, file and rank."""


class UnsafeDirectory(PermissionError):
    """A directory of the snapshot store that another user could change: refused, not reused."""


def checksum(data: bytes | memoryview) -> int:
    """crc32c, as durable checkpoints use (checkpoint/checksum.py): the one place to swap it."""
    return crc32c.crc32c(data)


def crc32c_update(data: bytes | memoryview, crc: int) -> int:
    """`checksum` of some bytes followed by `data`, given `crc`, the checksum of the former."""
    return crc32c.crc32c(data, crc)


def chunk_checksums(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> tuple[int, ...]:
    return tuple(checksum(data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes))


def chunk_span(entry: FileEntry, offset: int, length: int, where: str) -> tuple[int, int]:
    """The chunk-aligned byte range [start, end) that covers [offset, offset + length)."""
    if offset < 0 or length < 0 or offset + length > entry.size:
        raise SnapshotInvalid(
            f"{where}: range [{offset}, {offset + length}) is outside its {entry.size} bytes"
        )
    start = offset // CHUNK_BYTES * CHUNK_BYTES
    end = min(-(-(offset + length) // CHUNK_BYTES) * CHUNK_BYTES, entry.size)
    return start, end


def verify_span(entry: FileEntry, start: int, end: int, data: bytes, where: str) -> None:
    """Check `data`, meant to be bytes [start, end) of `entry` (from `chunk_span`)."""
    if entry.chunks is None:
        raise SnapshotInvalid(f"{where}: no checksums to verify against (its record is needed)")
    if len(data) != end - start:
        raise SnapshotInvalid(
            f"{where} is truncated: got {len(data)} of bytes [{start}, {end}), "
            f"the manifest says the file has {entry.size}"
        )
    for pos in range(0, len(data), CHUNK_BYTES):
        index = (start + pos) // CHUNK_BYTES
        if checksum(data[pos : pos + CHUNK_BYTES]) != entry.chunks[index]:
            raise SnapshotInvalid(f"{where}: checksum mismatch in chunk {index} (bytes {start + pos}+)")


# A byte item (DCP's pickled non-tensor values: progress, optimizer hyper-parameters) is stored
# in a slot: its length (4 bytes, little-endian), the bytes, then zeros up to the slot's size.
# The slot leaves room to grow, so later snapshots of a generation rewrite every item in place.
SLOT_SLACK = 256


def slot(data: bytes, size: int | None = None) -> bytes:
    """`data` in a slot of `size` bytes (default: with SLOT_SLACK to grow); ValueError when it
    does not fit."""
    size = 4 + len(data) + SLOT_SLACK if size is None else size
    if 4 + len(data) > size:
        raise ValueError(f"{len(data)} bytes do not fit a slot of {size}")
    return struct.pack("<I", len(data)) + data + bytes(size - 4 - len(data))


def unslot(data: bytes, step: int, file: str) -> bytes:
    if len(data) < 4 or struct.unpack("<I", data[:4])[0] > len(data) - 4:
        raise SnapshotInvalid(f"snapshot step {step}: file {file}: a byte item's slot is damaged")
    return data[4:4 + struct.unpack("<I", data[:4])[0]]


def default_base() -> Path:
    """The default base of the snapshot store: this user's own directory in shared memory."""
    return Path(f"/dev/shm/ultrascale-{os.geteuid()}")


def snapshot_root(job: str, base: Path | None = None) -> Path:
    """Where a node keeps the snapshots of `job` (`<base>/<job>`; the node's own are in
    `<base>/<job>/<node>`): agent and workers agree on this path."""
    if not job or "/" in job or job.startswith("."):
        raise ValueError(f"job name must be a plain file name (got {job!r})")
    return Path(default_base() if base is None else base) / job


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def private_dirs(top: Path, path: Path | None = None) -> Path:
    """`path` (default: `top`; else a directory below it), returned once every directory from
    `top` down to it is private: one that is missing is made (mode 0700; `top`'s parent must
    exist), one that exists must be a real directory (not a symbolic link) owned by this
    process's user and not writable by group or others, else UnsafeDirectory names it and what
    is wrong.

    Each directory is opened without following links and checked before the next is made in
    it, so what was checked is what the next one is made in. Once the chain is private nobody
    else can rename or plant anything in it, so callers may go on by path.
    """
    top = Path(top)
    names = Path(path).relative_to(top).parts if path is not None else ()
    if ".." in names:
        raise ValueError(f"{path} is not below {top}")
    fd = _private_dir(top, str(top), None)
    try:
        for name in names:
            top = top / name
            child = _private_dir(top, name, fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    return top


def _private_dir(path: Path, name: str, parent: int | None) -> int:
    """An fd of directory `name` (in `parent`, an fd; None: `name` is a path), made or checked
    as `private_dirs` says."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
        created = True
    except FileExistsError:
        created = False
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "snapshot directory: its parent does not exist",
                                str(path)) from None
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        link = stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
        raise UnsafeDirectory(f"snapshot directory {path} is "
                              f"{'a symbolic link' if link else 'not a directory'}: refused"
                              ) from None
    st = os.fstat(fd)
    wrong = ""
    if st.st_uid != os.geteuid():
        wrong = f"owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    elif st.st_mode & 0o022:
        wrong = f"writable by group or others (mode {st.st_mode & 0o7777:04o})"
    if wrong:
        os.close(fd)
        raise UnsafeDirectory(f"snapshot directory {path} is {wrong}: refused, not reused "
                              f"(remove it, or choose another --snapshot-dir)")
    if created:
        os.fchmod(fd, 0o700)  # the umask may have taken bits the owner needs
    return fd


def create_private_file(path: Path | str, dir_fd: int | None = None) -> int:
    """A new file at `path` (relative to `dir_fd` when given), mode 0600, open for writing; the
    caller closes the fd. O_EXCL|O_NOFOLLOW: whatever is at `path` already, a file or a link
    planted there, is never followed or reused (FileExistsError)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o600, dir_fd=dir_fd)


def step_dir(root: Path, step: int) -> Path:
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    return Path(root) / f"step_{step:08d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def discarded_name(step: int) -> str:
    """A name to move a step's directory to when its history is replaced: not a step's name,
    so nothing lists, serves or restores it, and unique (a step can be replaced twice before
    its discarded copy is removed)."""
    return f"{_DISCARDED_PREFIX}{step_dir(Path(), step).name}-{secrets.token_hex(8)}"


def is_discarded(name: str) -> bool:
    return name.startswith(_DISCARDED_PREFIX)


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.distcp"


def record_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"


_SHARD = re.compile(r"rank_(\d{5,})\.distcp")
_RECORD = re.compile(r"rank_(\d{5,})\.json")


def shard_rank(file: str) -> int | None:
    """The rank of a shard file's name (rank_<r>.distcp); None for any other name."""
    match = _SHARD.fullmatch(file)
    return int(match.group(1)) if match else None


def record_rank(file: str) -> int | None:
    """The rank of a shard record's name (rank_<r>.json); None for any other name."""
    match = _RECORD.fullmatch(file)
    return int(match.group(1)) if match else None


def read_held(root: Path, step: int, file: str, offset: int, length: int
              ) -> bytes | bytearray | None:
    """Raw bytes [offset, offset + length) (length < 0: to the end) of `file` of snapshot
    `step` under `root`; None when it is not there. Unverified: readers check what they use.
    Raises SnapshotInvalid for a name that is not a snapshot file's."""
    if shard_rank(file) is None and record_rank(file) is None \
            and file not in (METADATA_NAME, MANIFEST_NAME):
        raise SnapshotInvalid(f"snapshot step {step}: {file!r} is not a snapshot file name")
    try:
        fd = os.open(step_dir(root, step) / file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if length < 0:
            length = max(0, os.fstat(fd).st_size - offset)
        return pread_all(fd, length, offset)
    finally:
        os.close(fd)


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def pwritev_all(fd: int, buffers: list[memoryview]) -> None:
    """Write `buffers` back to back from offset 0, IOV_MAX at a time, resuming after a short
    write."""
    pending = [b for b in buffers if len(b)]
    first, offset = 0, 0
    while first < len(pending):
        written = os.pwritev(fd, pending[first:first + _IOV_MAX], offset)
        if written <= 0:
            raise OSError(f"pwritev wrote nothing at offset {offset}")
        offset += written
        while written:
            if written >= len(pending[first]):
                written -= len(pending[first])
                first += 1
            else:
                pending[first] = pending[first][written:]
                written = 0


def pread_all(fd: int, length: int, offset: int) -> bytes | bytearray:
    """`length` bytes of `fd` from `offset` (fewer only at its end). One pread(2) returns at
    most 2 GiB - 4 KiB on Linux: a bigger shard or item is read into one buffer, in pieces."""
    if length <= _PREAD_MAX:
        return os.pread(fd, length, offset)
    buffer = bytearray(length)
    view = memoryview(buffer)
    done = 0
    while done < length:
        got = os.preadv(fd, [view[done:done + _PREAD_MAX]], offset + done)
        if got == 0:
            return bytes(view[:done])
        done += got
    return buffer


def record_bytes(step: int, entry: FileEntry) -> bytes:
    """A rank's record of its shard of `step`: written after the shard, which it declares whole
    (`parse_record` reads it)."""
    return json.dumps({"step": step, **entry.to_json()}).encode()


def parse_record(data: bytes, step: int, entry: FileEntry, where: str) -> FileEntry:
    """A rank's record of its shard, checked against the manifest's entry for it."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotInvalid(f"{where}: its record is not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("step") != step:
        raise SnapshotInvalid(f"{where}: its record is not one of step {step}")
    record = FileEntry.from_json(raw, f"{where} record")
    if record.chunks is None or (record.path, record.rank, record.size) != (
            entry.path, entry.rank, entry.size):
        raise SnapshotInvalid(f"{where}: its record ({record.path}, rank {record.rank}, "
                              f"{record.size} bytes) does not match the manifest")
    return record


@dataclass(frozen=True)
class SnapshotItem:
    """Where one DCP write item lives: DCP's per-item `storage_data` in `.metadata`."""

    file: str
    offset: int
    length: int
    dtype: str | None  # torch dtype name ("float32") of a raw tensor; None for a byte item
    shape: tuple[int, ...]


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the step directory
    rank: int  # the rank that wrote it (the coordinator for .metadata)
    size: int
    # Checksum of each CHUNK_BYTES slice, in order. None in a manifest's shard entry: they are
    # in the rank's own record (`rank_<r>.json`), written by the rank after its shard.
    chunks: tuple[int, ...] | None

    def to_json(self) -> dict[str, Any]:
        chunks = None if self.chunks is None else list(self.chunks)
        return {"path": self.path, "rank": self.rank, "size": self.size, "chunks": chunks}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> FileEntry:
        if not isinstance(raw, dict):
            raise SnapshotInvalid(f"{where}: a file entry must be an object (got {raw!r})")
        path, rank, size, chunks = (raw.get(k) for k in ("path", "rank", "size", "chunks"))
        if not isinstance(path, str) or not path or "/" in path or path.startswith(".."):
            raise SnapshotInvalid(f"{where}: field 'path' must be a file name (got {path!r})")
        for name, value in (("rank", rank), ("size", size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SnapshotInvalid(f"{where} ({path}): field '{name}' must be an int >= 0 (got {value!r})")
        if chunks is None and shard_rank(path) is not None:
            return cls(path=path, rank=rank, size=size, chunks=None)
        if not isinstance(chunks, list) or not all(isinstance(c, int) for c in chunks):
            raise SnapshotInvalid(f"{where} ({path}): field 'chunks' must be a list of ints")
        if len(chunks) != -(-size // CHUNK_BYTES):
            raise SnapshotInvalid(
                f"{where} ({path}): field 'chunks' has {len(chunks)} checksums for {size} bytes"
            )
        return cls(path=path, rank=rank, size=size, chunks=tuple(chunks))


@dataclass(frozen=True)
class SnapshotManifest:
    step: int
    consumed_samples: int
    world_size: int
    layout: dict[str, Any]
    files: tuple[FileEntry, ...]  # every rank's shard, then .metadata
    chunk_bytes: int = CHUNK_BYTES
    version: int = FORMAT_VERSION

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise SnapshotInvalid(f"snapshot step {self.step}: file {path} is not in its manifest")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "world_size": self.world_size,
            "layout": self.layout,
            "chunk_bytes": self.chunk_bytes,
            "files": [f.to_json() for f in self.files],
        }

    def to_bytes(self) -> bytes:
        body = self._body()
        # The manifest checksums itself, so a flipped digit in a size or checksum is caught
        # as a bad manifest rather than blamed on the file it describes.
        body["checksum"] = checksum(_canonical(body))
        return json.dumps(body, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> SnapshotManifest:
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SnapshotInvalid(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise SnapshotInvalid(f"{where}: must be a JSON object")
        if raw.get("format") != FORMAT or raw.get("version") != FORMAT_VERSION:
            raise SnapshotInvalid(
                f"{where}: fields 'format'/'version' must be {FORMAT!r}/{FORMAT_VERSION} "
                f"(got {raw.get('format')!r}/{raw.get('version')!r})"
            )
        stored = raw.pop("checksum", None)
        if stored != checksum(_canonical(raw)):
            raise SnapshotInvalid(f"{where}: field 'checksum' does not match the manifest's content")
        for name in ("step", "consumed_samples", "world_size", "chunk_bytes"):
            value = raw.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SnapshotInvalid(f"{where}: field '{name}' must be an int >= 0 (got {value!r})")
        if raw["chunk_bytes"] != CHUNK_BYTES:
            raise SnapshotInvalid(
                f"{where}: field 'chunk_bytes' must be {CHUNK_BYTES} (got {raw['chunk_bytes']})"
            )
        if not isinstance(raw.get("layout"), dict):
            raise SnapshotInvalid(f"{where}: field 'layout' must be an object")
        files = raw.get("files")
        if not isinstance(files, list):
            raise SnapshotInvalid(f"{where}: field 'files' must be a list")
        entries = tuple(FileEntry.from_json(f, f"{where} files[{i}]") for i, f in enumerate(files))
        shard_ranks = sorted(e.rank for e in entries if e.path != METADATA_NAME)
        if shard_ranks != list(range(raw["world_size"])) or METADATA_NAME not in {e.path for e in entries}:
            raise SnapshotInvalid(
                f"{where}: field 'files' must hold one shard per rank 0..{raw['world_size'] - 1} "
                f"and {METADATA_NAME} (got shards of ranks {shard_ranks})"
            )
        return cls(
            step=raw["step"],
            consumed_samples=raw["consumed_samples"],
            world_size=raw["world_size"],
            layout=raw["layout"],
            files=entries,
        )


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` so readers see all of it or nothing (rename is atomic).

    The temporary file has a name nobody can guess and is created new (`create_private_file`),
    so a link planted in the directory is never written through; the rename replaces whatever
    is at `path`, a link included, without following it.
    No fsync: shared memory does not outlive the machine, and what it must outlive (a crashed
    writer) a rename already covers.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = create_private_file(tmp)
    try:
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(directory: Path, step: int) -> SnapshotManifest:
    path = Path(directory) / MANIFEST_NAME
    where = f"snapshot step {step}: {path}"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SnapshotInvalid(f"{where} is missing: the snapshot is incomplete") from None
    manifest = SnapshotManifest.parse(data, where)
    if manifest.step != step:
        raise SnapshotInvalid(f"{where}: field 'step' is {manifest.step}, the directory says {step}")
    return manifest
