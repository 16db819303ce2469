"""A snapshot's `.metadata`: where every item of the state lives, in a form that a restoring
rank reads without building an object per saved chunk (docs/snapshots.md, "What a restore
costs as the world grows").

DCP describes a checkpoint with a pickled `Metadata`: one `ChunkStorageMetadata` and one
storage record per tensor per saving rank. For a 1B Llama saved by 1,024 FSDP ranks that is a
65 MB pickle of 1.3 million objects, and every restoring rank unpickled all of it (6 s through
the allow-list) and let DCP's planner look at every chunk (0.4 s) to read the two or three
that overlap its own shard of each tensor. A snapshot's `.metadata` is ours (DCP's file
system reader never reads a snapshot), so it is written as an index instead:

    magic (8 bytes) | header length (little-endian uint64) | header (JSON) | padding to 8 |
    rows (little-endian int64)

The header names the shard files the items live in, each tensor (its key, dtype, whether it
requires grad, its global size, its rows' count) and each byte item (key, file, offset,
length). Each tensor's rows follow in the header's order, one per saved chunk in DCP's order,
`2 * ndim + 3` integers: the chunk's offsets and sizes, then its file (an index into the
header's files), offset and length. Reading it is one `json.loads` of a few hundred kilobytes
and one `numpy.frombuffer`; nothing in it is ever unpickled, so nothing in it can run.

`SnapshotIndex.skeleton()` is the `Metadata` DCP's load planner is given: every key with its
size and properties but no chunks; `SnapshotIndex.narrow` then picks, with one vectorised
comparison per tensor, the saved chunks that overlap the chunks this rank loads (DCP's own
overlap rule), and only those reach DCP's planner and the reader's storage records.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from checkpoint.snapshot_format import SnapshotInvalid, SnapshotItem

MAGIC = b"USNAPIX1"
_PREFIX = struct.Struct("<8sQ")
_ROW = np.dtype("<i8")
# A tensor's key, dtype, requires_grad, size and row count; a byte item's key, file, offset
# and length.
_TENSOR_FIELDS, _BYTES_FIELDS = 5, 4
_LIMIT = 2**62  # a tensor's bytes, and so every offset and size in its rows, stay below
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in vars(torch).values()
                                  if isinstance(d, torch.dtype)}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the saved state: its rows are `(n, 2 * ndim + 3)` int64, one per saved
    chunk (offsets, sizes, file, offset, length)."""

    fqn: str
    dtype: str
    requires_grad: bool
    size: tuple[int, ...]
    rows: np.ndarray

    @property
    def ndim(self) -> int:
        return len(self.size)


@dataclass(frozen=True)
class SnapshotIndex:
    files: tuple[str, ...]
    tensors: dict[str, TensorEntry]
    byte_items: dict[str, SnapshotItem]

    # -- writing ---------------------------------------------------------------------------

    @classmethod
    def of_metadata(cls, metadata: Metadata) -> SnapshotIndex:
        """The index of a full save's `Metadata`, whose storage records are `SnapshotItem`s.
        ValueError: something a snapshot never holds (another storage record, a chunk whose
        stored dtype is not its tensor's)."""
        storage: dict[MetadataIndex, Any] = metadata.storage_data or {}
        files: dict[str, int] = {}
        tensors: dict[str, TensorEntry] = {}
        byte_items: dict[str, SnapshotItem] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                byte_items[fqn] = _item(storage, MetadataIndex(fqn))
                files.setdefault(byte_items[fqn].file, len(files))
                continue
            dtype = str(md.properties.dtype).removeprefix("torch.")
            rows = []
            for i, chunk in enumerate(md.chunks):
                item = _item(storage, MetadataIndex(fqn, chunk.offsets, i))
                if item.dtype != dtype or tuple(item.shape) != tuple(chunk.sizes):
                    raise ValueError(f"{fqn}: a chunk stored as {item.dtype} {item.shape}, the "
                                     f"tensor is {dtype} with a chunk of {tuple(chunk.sizes)}")
                file = files.setdefault(item.file, len(files))
                rows.append((*chunk.offsets, *chunk.sizes, file, item.offset, item.length))
            width = 2 * len(md.size) + 3
            tensors[fqn] = TensorEntry(fqn, dtype, bool(md.properties.requires_grad),
                                       tuple(md.size),
                                       np.array(rows, dtype=_ROW).reshape(len(rows), width))
        return cls(tuple(files), tensors, byte_items)

    def to_bytes(self) -> bytes:
        file_ids = {name: i for i, name in enumerate(self.files)}
        header = json.dumps({
            "files": list(self.files),
            "tensors": [[t.fqn, t.dtype, t.requires_grad, list(t.size), len(t.rows)]
                        for t in self.tensors.values()],
            "bytes": [[fqn, file_ids[item.file], item.offset, item.length]
                      for fqn, item in self.byte_items.items()],
        }, separators=(",", ":")).encode()
        head = _PREFIX.pack(MAGIC, len(header)) + header
        padding = b"\0" * (-len(head) % _ROW.itemsize)
        rows = b"".join(np.ascontiguousarray(t.rows, dtype=_ROW).tobytes()
                        for t in self.tensors.values())
        return head + padding + rows

    # -- reading ---------------------------------------------------------------------------

    @classmethod
    def parse(cls, data: bytes, where: str) -> SnapshotIndex:
        """The index in `data`, every field checked: SnapshotInvalid names `where` and what is
        wrong. The files it names are checked against the manifest by the caller
        (`check_files`)."""
        if len(data) < _PREFIX.size:
            raise SnapshotInvalid(f"{where}: {len(data)} bytes, too short for an index")
        magic, length = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise SnapshotInvalid(f"{where}: not a snapshot index (it starts with {magic!r}, "
                                  f"not {MAGIC!r})")
        if length > len(data) - _PREFIX.size:
            raise SnapshotInvalid(f"{where}: its header of {length} bytes runs past its end")
        try:
            header = json.loads(data[_PREFIX.size:_PREFIX.size + length])
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SnapshotInvalid(f"{where}: its header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise SnapshotInvalid(f"{where}: its header is not a JSON object")
        files = _list(header, "files", where)
        if not all(isinstance(f, str) and f for f in files) or len(set(files)) != len(files):
            raise SnapshotInvalid(f"{where}: field 'files' must be distinct file names")
        start = _PREFIX.size + length
        start += -start % _ROW.itemsize
        if start > len(data) or (len(data) - start) % _ROW.itemsize:
            raise SnapshotInvalid(f"{where}: its rows are not whole int64s after its header")
        body = np.frombuffer(data, dtype=_ROW, offset=start)
        tensors: dict[str, TensorEntry] = {}
        used = 0
        for raw in _list(header, "tensors", where):
            entry = _tensor(raw, where)
            width = 2 * entry.ndim + 3
            count = len(entry.rows)  # _tensor leaves an empty array of the right row count
            rows = body[used:used + count * width]
            if len(rows) != count * width:
                raise SnapshotInvalid(f"{where}: tensor {entry.fqn}'s {count} rows run past the "
                                      "end of the file")
            used += count * width
            entry = TensorEntry(entry.fqn, entry.dtype, entry.requires_grad, entry.size,
                                rows.reshape(count, width))
            if entry.fqn in tensors:
                raise SnapshotInvalid(f"{where}: tensor {entry.fqn} is listed twice")
            tensors[entry.fqn] = entry
        if used != len(body):
            raise SnapshotInvalid(f"{where}: {len(body) - used} int64s after the last tensor's "
                                  "rows")
        _check_rows(list(tensors.values()), len(files), where)
        byte_items: dict[str, SnapshotItem] = {}
        for raw in _list(header, "bytes", where):
            if not (isinstance(raw, list) and len(raw) == _BYTES_FIELDS
                    and isinstance(raw[0], str) and all(_count(n) for n in raw[1:])
                    and raw[1] < len(files)):
                raise SnapshotInvalid(f"{where}: a byte item is not [key, file, offset, length] "
                                      f"with a file of its {len(files)}: {str(raw)[:200]}")
            if raw[0] in byte_items or raw[0] in tensors:
                raise SnapshotInvalid(f"{where}: key {raw[0]} is listed twice")
            byte_items[raw[0]] = SnapshotItem(files[raw[1]], raw[2], raw[3], None, ())
        return cls(tuple(files), tensors, byte_items)

    def check_files(self, sizes: dict[str, int], where: str) -> None:
        """Every item lies inside a file of the manifest (`sizes`: its files' sizes)."""
        for name in self.files:
            if name not in sizes:
                raise SnapshotInvalid(f"{where}: it names file {name}, which is not in the "
                                      "manifest")
        ends = np.array([sizes[name] for name in self.files], dtype=_ROW)
        tensors = list(self.tensors.values())
        if tensors:
            owner = np.repeat(np.arange(len(tensors)), [len(t.rows) for t in tensors])
            placed = np.concatenate([t.rows[:, -3:] for t in tensors])  # file, offset, length
            # offset > end - length: offset + length could overflow, length (< 2**62) not.
            past = placed[:, 1] > ends[placed[:, 0]] - placed[:, 2]
            if past.any():
                t = tensors[int(owner[np.argmax(past)])]
                raise SnapshotInvalid(f"{where}: a chunk of {t.fqn} lies past the end of its "
                                      "file")
        for fqn, item in self.byte_items.items():
            if item.offset + item.length > sizes[item.file]:
                raise SnapshotInvalid(f"{where}: byte item {fqn} lies past the end of "
                                      f"{item.file}")

    def skeleton(self) -> Metadata:
        """DCP `Metadata` with every key, each tensor's size and properties and no chunks
        (`narrow` adds the ones a rank reads), and every byte item's storage record."""
        state: dict[str, Any] = {
            fqn: TensorStorageMetadata(
                TensorProperties(dtype=DTYPES[t.dtype], requires_grad=t.requires_grad),
                torch.Size(t.size), [])
            for fqn, t in self.tensors.items()}
        state.update((fqn, BytesStorageMetadata()) for fqn in self.byte_items)
        storage = {MetadataIndex(fqn): item for fqn, item in self.byte_items.items()}
        return Metadata(state_dict_metadata=state, storage_data=storage)

    def narrow(self, fqn: str, local: Iterable[ChunkStorageMetadata]
               ) -> list[tuple[ChunkStorageMetadata, MetadataIndex, SnapshotItem]]:
        """The saved chunks of tensor `fqn` that overlap any of `local` (DCP's rule: in every
        dimension each starts before the other ends), in saved order, with their storage
        records."""
        t = self.tensors[fqn]
        d, rows = t.ndim, t.rows
        hit = np.zeros(len(rows), dtype=bool)
        for chunk in local:
            offsets = np.array(chunk.offsets, dtype=_ROW).reshape(d)
            ends = offsets + np.array(chunk.sizes, dtype=_ROW).reshape(d)
            hit |= np.all((rows[:, :d] < ends) & (rows[:, :d] + rows[:, d:2 * d] > offsets),
                          axis=1)
        out = []
        for i in np.flatnonzero(hit).tolist():
            row = rows[i].tolist()
            offsets, sizes = torch.Size(row[:d]), torch.Size(row[d:2 * d])
            item = SnapshotItem(self.files[row[-3]], row[-2], row[-1], t.dtype, tuple(sizes))
            out.append((ChunkStorageMetadata(offsets, sizes), MetadataIndex(fqn, offsets, i),
                        item))
        return out


def _item(storage: dict[MetadataIndex, Any], index: MetadataIndex) -> SnapshotItem:
    item = storage.get(index)
    if not isinstance(item, SnapshotItem):
        raise ValueError(f"{index.fqn}: its storage record is {type(item).__name__}, not a "
                         "snapshot's")
    return item


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _list(header: dict[str, Any], field: str, where: str) -> list[Any]:
    value = header.get(field)
    if not isinstance(value, list):
        raise SnapshotInvalid(f"{where}: field {field!r} of its header is missing or not a list")
    return value


def _tensor(raw: Any, where: str) -> TensorEntry:
    """A header's tensor entry, with an empty (count, 0) placeholder for its rows."""
    if not (isinstance(raw, list) and len(raw) == _TENSOR_FIELDS and isinstance(raw[0], str)
            and isinstance(raw[1], str) and isinstance(raw[2], bool)
            and isinstance(raw[3], list) and all(_count(n) for n in raw[3]) and _count(raw[4])):
        raise SnapshotInvalid(f"{where}: a tensor entry is not [key, dtype, requires_grad, "
                              f"size, rows]: {str(raw)[:200]}")
    if any(n >= _LIMIT for n in raw[3]) or math.prod(raw[3]) * DTYPES.get(raw[1], torch.uint8
                                                                           ).itemsize >= _LIMIT:
        raise SnapshotInvalid(f"{where}: tensor {raw[0]} has a size of 2**62 bytes or more")
    if raw[1] not in DTYPES:
        raise SnapshotInvalid(f"{where}: tensor {raw[0]} has dtype {raw[1]!r}, which is no "
                              "torch dtype")
    return TensorEntry(raw[0], raw[1], raw[2], tuple(raw[3]), np.empty((raw[4], 0), dtype=_ROW))


def _check_rows(tensors: list[TensorEntry], files: int, where: str) -> None:
    """Each chunk lies inside its tensor and its bytes are its elements'. All tensors of a
    rank (number of dims) are checked at once: per tensor, the numpy calls cost more than the
    checks. The error names the first tensor, in the header's order, with a bad chunk."""
    bad: dict[int, str] = {}  # position in `tensors` -> what is wrong with it
    by_ndim: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if len(t.rows):
            by_ndim.setdefault(t.ndim, []).append(i)
    for d, members in by_ndim.items():
        group = [tensors[i] for i in members]
        owner = np.repeat(np.arange(len(group)), [len(t.rows) for t in group])
        rows = np.concatenate([t.rows for t in group])
        offsets, sizes = rows[:, :d], rows[:, d:2 * d]
        size = np.array([t.size for t in group], dtype=_ROW).reshape(len(group), d)[owner]
        # A row with an offset or size above the tensor's is refused whatever its sum says:
        # in the others both are < 2**62, and their sum cannot overflow.
        outside = (rows < 0).any(axis=1) | (offsets > size).any(axis=1) | \
            (sizes > size).any(axis=1) | (offsets + sizes > size).any(axis=1)
        file = rows[:, -3] >= files
        itemsize = np.array([DTYPES[t.dtype].itemsize for t in group], dtype=_ROW)[owner]
        with np.errstate(over="ignore"):  # only in rows already refused as outside
            elements = np.prod(sizes, axis=1, dtype=_ROW)
        length = rows[:, -1] != elements * itemsize
        for flags, says in ((outside, "outside"), (file, "file"), (length, "length")):
            for k in np.unique(owner[flags]).tolist():
                bad.setdefault(members[k], says)
    if not bad:
        return
    first = min(bad)
    t, says = tensors[first], bad[first]
    if says == "outside":
        raise SnapshotInvalid(f"{where}: a chunk of {t.fqn} lies outside its size {t.size}")
    if says == "file":
        raise SnapshotInvalid(f"{where}: a chunk of {t.fqn} names a file past its {files}")
    raise SnapshotInvalid(f"{where}: a chunk of {t.fqn} has a length that is not its "
                          f"elements' ({t.dtype})")
