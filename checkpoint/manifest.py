"""The manifest that turns a directory of DCP files into a checkpoint.

A checkpoint is `<root>/step_<8-digit step>/`: the files DCP wrote plus `manifest.json`, written
last and atomically. The manifest lists every file with its size and sha256, so a truncated shard,
a flipped byte or a half-written directory is caught here, with the file named, instead of deep
inside a DCP load. A directory without a valid manifest is not a checkpoint (docs/architecture.md,
"State").

Pure file I/O, no torch: the agent and command-line tools verify checkpoints without it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT = "ultrascale-checkpoint"
FORMAT_VERSION = 1
# Our own temporary manifest and DCP's `.metadata.tmp` both end in this; neither is checkpoint data.
TMP_SUFFIX = ".tmp"
_CHUNK = 1 << 20
_STEP_DIR = re.compile(r"step_(\d{8,})")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointInvalid(ValueError):
    """A directory is not a usable checkpoint; the message names the file and the problem."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the checkpoint directory, '/'-separated
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    consumed_samples: int
    layout: dict[str, Any]
    files: tuple[FileEntry, ...]
    created: str  # ISO 8601, UTC
    extra: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "layout": self.layout,
            "created": self.created,
            "extra": self.extra,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
        }


def checkpoint_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives under `root`."""
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    return Path(root) / f"step_{step:08d}"


# --- writing ----------------------------------------------------------------------------------


def write_manifest(
    ckpt_dir: Path,
    *,
    step: int,
    consumed_samples: int,
    layout: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Describe every file of `ckpt_dir` and commit the checkpoint by writing its manifest.

    Call only after the DCP save has finished on every rank: from the moment this returns, the
    directory is a checkpoint, durably.
    """
    ckpt_dir = Path(ckpt_dir)
    if step < 0 or consumed_samples < 0:
        raise ValueError(f"step and consumed_samples must be >= 0 (got {step}, {consumed_samples})")
    rel_paths, subdirs = _walk(ckpt_dir)
    files = tuple(_describe(ckpt_dir, rel) for rel in rel_paths)
    for sub in subdirs:
        _fsync_dir(sub)
    manifest = Manifest(
        step=step,
        consumed_samples=consumed_samples,
        layout=dict(layout),
        files=files,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        extra=dict(extra or {}),
    )
    path = ckpt_dir / MANIFEST_NAME
    _write_atomically(path, json.dumps(manifest.to_json(), indent=1).encode())
    # The step directory's own entry in root must be durable too: retention deletes the previous
    # checkpoint right after this returns, and a crash must not leave neither.
    _fsync_dir(ckpt_dir.parent)
    return path


def _walk(ckpt_dir: Path) -> tuple[list[str], list[Path]]:
    """Relative paths of the data files (sorted) and the subdirectories holding any."""
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    rel_paths: list[str] = []
    subdirs: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(ckpt_dir):
        dirnames.sort()
        here = Path(dirpath)
        if here != ckpt_dir:
            subdirs.append(here)
        for name in sorted(filenames):
            rel = (here / name).relative_to(ckpt_dir).as_posix()
            if rel != MANIFEST_NAME and not name.endswith(TMP_SUFFIX):
                rel_paths.append(rel)
    return rel_paths, subdirs


def _describe(ckpt_dir: Path, rel: str) -> FileEntry:
    with open(ckpt_dir / rel, "rb") as f:
        size, digest = _hash_stream(f)
        # The manifest promises these bytes survive a crash. DCP already fsyncs with
        # sync_files=True, so this is nearly free then, and it covers writers that don't.
        os.fsync(f.fileno())
    return FileEntry(path=rel, size=size, sha256=digest)


def _hash_stream(f: Any) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one, never a prefix, even across a crash."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    # A rename or create is durable only once the directory holding the entry is synced.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading and verifying --------------------------------------------------------------------


def read_manifest(ckpt_dir: Path) -> Manifest:
    """Parse and validate `ckpt_dir`'s manifest, without looking at the files it lists."""
    ckpt_dir = Path(ckpt_dir)
    where = f"{ckpt_dir.name}/{MANIFEST_NAME}"
    try:
        raw = (ckpt_dir / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid(f"{where}: manifest missing (not a checkpoint)") from None
    except OSError as e:
        raise CheckpointInvalid(f"{where}: manifest unreadable ({e.strerror})") from e
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointInvalid(f"{where}: malformed manifest: not valid JSON ({e})") from e
    return _parse(doc, where)


def verify(ckpt_dir: Path, *, checksums: bool = True) -> Manifest:
    """Return the manifest of `ckpt_dir` if every file it lists is present and intact.

    Sizes are checked for all files before any checksum, so a truncated shard is reported as
    such (and quickly) rather than as a checksum mismatch.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    _check_step_name(ckpt_dir, manifest)
    for entry in manifest.files:
        _check_size(ckpt_dir, entry)
    if checksums:
        for entry in manifest.files:
            _check_checksum(ckpt_dir, entry)
    return manifest


def _check_step_name(ckpt_dir: Path, manifest: Manifest) -> None:
    dir_step = _step_of(ckpt_dir.name)
    if dir_step is not None and dir_step != manifest.step:
        raise CheckpointInvalid(
            f"{ckpt_dir.name}/{MANIFEST_NAME}: step {manifest.step} in manifest "
            f"!= {dir_step} in directory name"
        )


def _check_size(ckpt_dir: Path, entry: FileEntry) -> None:
    label = f"{ckpt_dir.name}/{entry.path}"
    try:
        st = (ckpt_dir / entry.path).stat()
    except FileNotFoundError:
        raise CheckpointInvalid(f"{label}: file missing (listed in manifest)") from None
    except OSError as e:
        raise CheckpointInvalid(f"{label}: unreadable ({e.strerror})") from e
    if not (ckpt_dir / entry.path).is_file():
        raise CheckpointInvalid(f"{label}: not a regular file")
    if st.st_size != entry.size:
        raise CheckpointInvalid(f"{label}: size {st.st_size} != {entry.size} in manifest")


def _check_checksum(ckpt_dir: Path, entry: FileEntry) -> None:
    label = f"{ckpt_dir.name}/{entry.path}"
    try:
        with open(ckpt_dir / entry.path, "rb") as f:
            _, digest = _hash_stream(f)
    except OSError as e:
        raise CheckpointInvalid(f"{label}: unreadable ({e.strerror})") from e
    if digest != entry.sha256:
        raise CheckpointInvalid(f"checksum mismatch in {label}")


def _parse(doc: Any, where: str) -> Manifest:
    if not isinstance(doc, dict):
        raise _malformed(where, "the top level must be a JSON object")
    if _get(doc, "format", str, where) != FORMAT:
        raise _malformed(where, f"field 'format' must be {FORMAT!r} (got {doc['format']!r})")
    version = _get_count(doc, "version", where)
    if version != FORMAT_VERSION:
        raise _malformed(where, f"field 'version' is {version}; this build reads {FORMAT_VERSION}")
    files_raw = _get(doc, "files", list, where)
    files = tuple(_parse_entry(item, f"files[{i}]", where) for i, item in enumerate(files_raw))
    seen: set[str] = set()
    for i, entry in enumerate(files):
        if entry.path in seen:
            raise _malformed(where, f"field 'files[{i}].path' repeats {entry.path!r}")
        seen.add(entry.path)
    return Manifest(
        step=_get_count(doc, "step", where),
        consumed_samples=_get_count(doc, "consumed_samples", where),
        layout=_get(doc, "layout", dict, where),
        files=files,
        created=_get(doc, "created", str, where),
        extra=_get(doc, "extra", dict, where),
        version=version,
    )


def _parse_entry(item: Any, name: str, where: str) -> FileEntry:
    if not isinstance(item, dict):
        raise _malformed(where, f"field '{name}' must be an object (got {item!r})")
    path = _get(item, "path", str, where, prefix=name)
    parts = path.split("/")
    # A manifest must not send a verifier (or retention) outside its own directory.
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise _malformed(where, f"field '{name}.path' must be a plain relative path (got {path!r})")
    sha = _get(item, "sha256", str, where, prefix=name)
    if not _SHA256.fullmatch(sha):
        raise _malformed(where, f"field '{name}.sha256' must be 64 lowercase hex digits")
    return FileEntry(path=path, size=_get_count(item, "size", where, prefix=name), sha256=sha)


def _get(obj: dict[str, Any], key: str, kind: type, where: str, prefix: str = "") -> Any:
    name = f"{prefix}.{key}" if prefix else key
    if key not in obj:
        raise _malformed(where, f"field '{name}' is missing")
    value = obj[key]
    if not isinstance(value, kind):
        raise _malformed(where, f"field '{name}' must be {kind.__name__} (got {value!r})")
    return value


def _get_count(obj: dict[str, Any], key: str, where: str, prefix: str = "") -> int:
    value = _get(obj, key, int, where, prefix)
    # bool is an int in Python but never a valid count.
    if isinstance(value, bool) or value < 0:
        name = f"{prefix}.{key}" if prefix else key
        raise _malformed(where, f"field '{name}' must be a non-negative integer (got {value!r})")
    return value


def _malformed(where: str, problem: str) -> CheckpointInvalid:
    return CheckpointInvalid(f"{where}: malformed manifest: {problem}")


# --- the checkpoints under a root -------------------------------------------------------------


def _step_of(name: str) -> int | None:
    m = _STEP_DIR.fullmatch(name)
    # Only the canonical spelling, so `step_000000012` cannot shadow `step_00000012`.
    if m is None or name != f"step_{int(m.group(1)):08d}":
        return None
    return int(m.group(1))


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Every `step_XXXXXXXX` directory under `root`, newest first, valid or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = _step_of(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found, key=lambda sp: sp[0], reverse=True)


def latest_valid(
    root: Path, *, on_skip: Callable[[str], None], checksums: bool = True
) -> tuple[Manifest, Path] | None:
    """The newest checkpoint that verifies; `on_skip` hears about each newer one that does not."""
    for _, path in list_checkpoints(root):
        try:
            return verify(path, checksums=checksums), path
        except CheckpointInvalid as e:
            on_skip(f"checkpoint {path.name} is invalid ({e}); trying an older one")
    return None


def apply_retention(root: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` valid checkpoints; remove older ones and older broken directories.

    Directories newer than the newest valid checkpoint are left alone: one may be in the middle
    of an async save. Validity here is sizes only: retention runs every checkpoint and must not
    re-read gigabytes; a resume verifies checksums anyway. Returns the removed directories.
    """
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1 (got {keep})")
    removed: list[Path] = []
    valid_seen = 0
    for _, path in list_checkpoints(root):
        try:
            verify(path, checksums=False)
        except CheckpointInvalid:
            if valid_seen:
                _remove(path)
                removed.append(path)
            continue
        valid_seen += 1
        if valid_seen > keep:
            _remove(path)
            removed.append(path)
    return removed


def _remove(path: Path) -> None:
    # Manifest first: the checkpoint stops existing at one atomic point, so a crash mid-delete
    # leaves a directory that is plainly not a checkpoint rather than one missing a shard.
    (path / MANIFEST_NAME).unlink(missing_ok=True)
    _fsync_dir(path)
    shutil.rmtree(path)
