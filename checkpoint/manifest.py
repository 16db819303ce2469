"""The manifest that turns a directory of DCP files into a checkpoint.

A checkpoint is `<root>/step_<8-digit step>/`: the files DCP wrote plus `manifest.json`, written
last and atomically. The manifest (format: checkpoint/manifest_format.py) lists every file with
its size and checksums (checkpoint/checksum.py), so a truncated shard, a flipped byte or a
half-written directory is caught, with the file named, instead of deep inside a DCP load. A
directory without a valid manifest is not a checkpoint (docs/architecture.md, "State").
In training every rank checksums the files it writes and verifies the blocks it reads
(checkpoint/checksummed_storage.py, docs/checkpoints.md); `verify` here checks whole
directories in one process, for tools.

Pure file I/O, no torch: the agent and command-line tools verify checkpoints without it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from checkpoint.checksum import CURRENT, Scheme, bad_blocks, digest_stream
from checkpoint.manifest_format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    READABLE_VERSIONS,
    TMP_SUFFIX,
    CheckpointInvalid,
    FileEntry,
    Manifest,
    read_manifest,
)

# Re-exported: callers import the whole checkpoint-manifest API from here.
__all__ = [
    "FORMAT", "FORMAT_VERSION", "MANIFEST_NAME", "READABLE_VERSIONS", "TMP_SUFFIX",
    "CheckpointInvalid", "FileEntry", "Manifest", "apply_retention", "check_manifest",
    "checkpoint_dir", "committed_steps", "fsync_dir", "latest_valid", "list_checkpoints",
    "prune_fragments", "read_manifest", "verify", "verify_reads", "verify_whole",
    "write_manifest",
]

_STEP_DIR = re.compile(r"step_(\d{8,})")


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
    files: Sequence[FileEntry] | None = None,
    scheme: Scheme = CURRENT,
    present: Iterable[str] | None = None,
) -> Path:
    """Commit the checkpoint in `ckpt_dir` by writing its manifest.

    `files` are the entries the writers computed as they wrote (every file of the directory,
    checksummed with `scheme`); without them every file is read and checksummed here. `present`
    limits the size check of reported files to those paths: on a node-local directory
    (checkpoint.storage "node") the other nodes' shards are not here, and their writers' own
    entries are all there is to know of them. Call only
    after the DCP save has finished on every rank, with every file it lists fsynced
    (checkpoint/checksummed_storage.py does; `files=None` reads and fsyncs each one here): the
    directories are fsynced here, then the manifest is written to a temporary file, fsynced,
    renamed into place and the directory fsynced again. From the moment this returns, the
    directory is a checkpoint, durably.
    """
    ckpt_dir = Path(ckpt_dir)
    if step < 0 or consumed_samples < 0:
        raise ValueError(f"step and consumed_samples must be >= 0 (got {step}, {consumed_samples})")
    rel_paths, subdirs = _walk(ckpt_dir)
    if files is None:
        files = tuple(_describe(ckpt_dir, rel, scheme) for rel in rel_paths)
    else:
        files = _check_reported(ckpt_dir, files, scheme, present)
    # Every entry (DCP renames `.metadata` into place) must be durable before the manifest is.
    for sub in (*subdirs, ckpt_dir):
        fsync_dir(sub)
    manifest = Manifest(
        step=step,
        consumed_samples=consumed_samples,
        layout=dict(layout),
        files=files,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        extra=dict(extra or {}),
        scheme=scheme,
    )
    path = ckpt_dir / MANIFEST_NAME
    _write_atomically(path, json.dumps(manifest.to_json(), indent=1).encode())
    # The step directory's own entry in root must be durable too: retention deletes the previous
    # checkpoint right after this returns, and a crash must not leave neither.
    fsync_dir(ckpt_dir.parent)
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


def _describe(ckpt_dir: Path, rel: str, scheme: Scheme) -> FileEntry:
    with open(ckpt_dir / rel, "rb") as f:
        size, digests = digest_stream(f, scheme)
        # The manifest promises these bytes survive a crash: nearly free after a writer that
        # fsyncs (ours does), and it covers those that don't.
        os.fsync(f.fileno())
    return FileEntry(path=rel, size=size, digests=digests)


def _check_reported(
    ckpt_dir: Path, files: Sequence[FileEntry], scheme: Scheme, present: Iterable[str] | None
) -> tuple[FileEntry, ...]:
    """The writers' entries, sorted, once each file's size on disk (stat only) agrees.

    Files on disk that no writer reported are left out: they are leftovers of an earlier save
    into the same step directory (a run resumed from an older checkpoint saves this step again),
    which this save's `.metadata` never points at; a load that tried to read one would fail
    verification, as the file is not in the manifest.
    """
    by_path = {f.path: f for f in files}
    here = None if present is None else set(present)
    for entry in files:
        if here is None or entry.path in here:
            _check_size(ckpt_dir, entry)
        if len(entry.digests) != scheme.block_count(entry.size):
            raise CheckpointInvalid(
                f"{ckpt_dir.name}/{entry.path}: reported digests do not match its size"
            )
    return tuple(sorted(by_path.values(), key=lambda f: f.path))


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
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` durable: a create or rename is durable only once
    the directory holding the entry is synced."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading and verifying --------------------------------------------------------------------


def verify(ckpt_dir: Path, *, checksums: bool = True) -> Manifest:
    """Return the manifest of `ckpt_dir` if every file it lists is present and intact.

    Sizes are checked for all files before any checksum, so a truncated shard is reported as
    such (and quickly) rather than as a checksum mismatch.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest = check_manifest(ckpt_dir)
    for entry in manifest.files:
        _check_size(ckpt_dir, entry)
    if checksums:
        for entry in manifest.files:
            _check_blocks(ckpt_dir, manifest.scheme, entry, range(len(entry.digests)))
    return manifest


def check_manifest(ckpt_dir: Path) -> Manifest:
    """The manifest of `ckpt_dir`, parsed and matched to the directory name; files unchecked."""
    manifest = read_manifest(ckpt_dir)
    _check_step_name(Path(ckpt_dir), manifest)
    return manifest


def verify_whole(ckpt_dir: Path, manifest: Manifest, paths: Iterable[str]) -> None:
    """Check the size and every checksum of each of `paths`."""
    sizes = {p: (e.size if (e := manifest.entry(p)) else 0) for p in paths}
    verify_reads(ckpt_dir, manifest, {p: [(0, size)] for p, size in sizes.items()})


def verify_reads(
    ckpt_dir: Path, manifest: Manifest, reads: Mapping[str, Iterable[tuple[int, int]]]
) -> dict[str, tuple[int, ...]]:
    """Check the files a loader will read, given as path → byte ranges (offset, length): each
    file's size, then the checksum of every block the ranges touch (the whole file for a version-1
    manifest). Returns the blocks checked per file."""
    ckpt_dir = Path(ckpt_dir)
    entries = []
    for rel, ranges in sorted(reads.items()):
        entry = manifest.entry(rel)
        if entry is None:
            raise CheckpointInvalid(f"{ckpt_dir.name}/{rel}: read by DCP but not in the manifest")
        _check_size(ckpt_dir, entry)
        entries.append((entry, sorted(manifest.scheme.blocks_covering(ranges))))
    for entry, blocks in entries:
        _check_blocks(ckpt_dir, manifest.scheme, entry, blocks)
    return {entry.path: tuple(blocks) for entry, blocks in entries}


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


def _check_blocks(ckpt_dir: Path, scheme: Scheme, entry: FileEntry, blocks: Iterable[int]) -> None:
    label = f"{ckpt_dir.name}/{entry.path}"
    try:
        with open(ckpt_dir / entry.path, "rb") as f:
            bad = bad_blocks(f, scheme, entry.digests, blocks)
    except OSError as e:
        raise CheckpointInvalid(f"{label}: unreadable ({e.strerror})") from e
    if bad and len(entry.digests) > 1:
        start = bad[0] * scheme.block_bytes
        end = min(entry.size, start + scheme.block_bytes)
        raise CheckpointInvalid(f"checksum mismatch in {label} (block {bad[0]}, bytes {start}-{end})")
    if bad:
        raise CheckpointInvalid(f"checksum mismatch in {label}")


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


def committed_steps(root: Path) -> list[int]:
    """The steps under `root` whose manifest parses and matches its directory, newest first:
    the checkpoints that were committed (their files unchecked)."""
    committed = []
    for step, path in list_checkpoints(root):
        try:
            check_manifest(path)
        except CheckpointInvalid:
            continue
        committed.append(step)
    return committed


def apply_retention(root: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` valid checkpoints; remove older ones and older broken directories.

    Run it only once a checkpoint has just been committed, with no save in flight. Directories
    newer than the newest valid checkpoint are left alone (one may be a save about to start
    again), and the newest valid one is never removed, so a failed or half-written save never
    costs the last good checkpoint. Validity here is sizes only: retention runs every checkpoint
    and must not re-read gigabytes; a resume verifies checksums anyway. Returns the removed
    directories.
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


def prune_fragments(root: Path, keep: int, committed: Sequence[int]) -> list[Path]:
    """Retention on a node-local root (checkpoint.storage "node"), given the `committed` steps.

    Such a directory holds only this node's shards (and, on global rank 0's node, the manifest
    and `.metadata`), so whether it is a checkpoint is known only where the manifests are:
    `committed` is what global rank 0's root holds (`committed_steps`). The newest `keep`
    committed steps stay; older committed ones go; a step never committed goes only when it is
    older than the newest committed one (a failed save's leftovers), so with nothing committed
    nothing goes. Run it with no save in flight. Every rank of a node may prune the same root
    at once, so a directory another one removed first is not an error. Returns the removed
    directories.
    """
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1 (got {keep})")
    newest_first = sorted(set(committed), reverse=True)
    kept = set(newest_first[:keep])
    removed: list[Path] = []
    for step, path in list_checkpoints(root):
        if step in kept or not newest_first or step > newest_first[0]:
            continue
        (path / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _remove(path: Path) -> None:
    # Manifest first: the checkpoint stops existing at one atomic point, so a crash mid-delete
    # leaves a directory that is plainly not a checkpoint rather than one missing a shard.
    (path / MANIFEST_NAME).unlink(missing_ok=True)
    fsync_dir(path)
    shutil.rmtree(path)
