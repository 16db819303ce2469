"""The manifest's format: what it holds, and parsing it with errors that name the field.

Version 2 names its checksum scheme and lists one digest per block of each file; version 1 (one
sha256 per file) is still read, so checkpoints written by earlier builds restore. Pure JSON, no
file walking: checkpoint/manifest.py writes, verifies and retires checkpoints.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint.checksum import CURRENT, LEGACY, SHA256, Scheme

MANIFEST_NAME = "manifest.json"
FORMAT = "ultrascale-checkpoint"
FORMAT_VERSION = 2
# Version 1 (one sha256 per file, hashed by rank 0 alone) is still read, so old checkpoints restore.
READABLE_VERSIONS = (1, 2)
# Our own temporary manifest and DCP's `.metadata.tmp` both end in this; neither is checkpoint data.
TMP_SUFFIX = ".tmp"


class CheckpointInvalid(ValueError):
    """A directory is not a usable checkpoint; the message names the file and the problem."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the checkpoint directory, '/'-separated
    size: int
    digests: tuple[str, ...]  # lowercase hex, one per block of the manifest's scheme


@dataclass(frozen=True)
class Manifest:
    step: int
    consumed_samples: int
    layout: dict[str, Any]
    files: tuple[FileEntry, ...]
    created: str  # ISO 8601, UTC
    extra: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    scheme: Scheme = CURRENT

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)

    def to_json(self) -> dict[str, Any]:
        doc = {
            "format": FORMAT,
            "version": self.version,
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "layout": self.layout,
            "created": self.created,
            "extra": self.extra,
        }
        algo = self.scheme.algorithm
        if self.version == 1:
            files = [{"path": f.path, "size": f.size, algo: f.digests[0]} for f in self.files]
        else:
            doc["checksum"] = {"algorithm": algo, "block_bytes": self.scheme.block_bytes}
            files = [{"path": f.path, "size": f.size, algo: list(f.digests)} for f in self.files]
        return {**doc, "files": files}


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


def _parse(doc: Any, where: str) -> Manifest:
    if not isinstance(doc, dict):
        raise _malformed(where, "the top level must be a JSON object")
    if _get(doc, "format", str, where) != FORMAT:
        raise _malformed(where, f"field 'format' must be {FORMAT!r} (got {doc['format']!r})")
    version = _get_count(doc, "version", where)
    if version not in READABLE_VERSIONS:
        raise _malformed(where, f"field 'version' is {version}; this build reads {READABLE_VERSIONS}")
    scheme = LEGACY if version == 1 else _parse_scheme(doc, where)
    files_raw = _get(doc, "files", list, where)
    files = tuple(
        _parse_entry(item, f"files[{i}]", where, scheme, version) for i, item in enumerate(files_raw)
    )
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
        scheme=scheme,
    )


def _parse_scheme(doc: dict[str, Any], where: str) -> Scheme:
    raw = _get(doc, "checksum", dict, where)
    algorithm = _get(raw, "algorithm", str, where, prefix="checksum")
    block_bytes = _get_count(raw, "block_bytes", where, prefix="checksum")
    try:
        return Scheme(algorithm, block_bytes)
    except ValueError as e:
        raise _malformed(where, f"field 'checksum': {e}") from e


def _parse_entry(item: Any, name: str, where: str, scheme: Scheme, version: int) -> FileEntry:
    if not isinstance(item, dict):
        raise _malformed(where, f"field '{name}' must be an object (got {item!r})")
    path = _get(item, "path", str, where, prefix=name)
    parts = path.split("/")
    # A manifest must not send a verifier (or retention) outside its own directory.
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise _malformed(where, f"field '{name}.path' must be a plain relative path (got {path!r})")
    size = _get_count(item, "size", where, prefix=name)
    algo, width = scheme.algorithm, scheme.digest_hex
    if version == 1:
        digests: Any = (_get(item, SHA256, str, where, prefix=name),)
    else:
        digests = _get(item, algo, list, where, prefix=name)
    hexdigit = re.compile(f"[0-9a-f]{{{width}}}")
    if not all(isinstance(d, str) and hexdigit.fullmatch(d) for d in digests):
        raise _malformed(where, f"field '{name}.{algo}' must hold {width}-digit lowercase hex digests")
    if len(digests) != scheme.block_count(size):
        raise _malformed(
            where, f"field '{name}.{algo}' has {len(digests)} digests; size {size} needs "
            f"{scheme.block_count(size)}"
        )
    return FileEntry(path=path, size=size, digests=tuple(digests))


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
