"""A snapshot's `.metadata` index: it round-trips DCP's Metadata, its narrowing gives DCP's
planner exactly the reads a plan over every saved chunk gives, and every field of a damaged or
forged one is refused by name."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import struct

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from checkpoint.snapshot_format import SnapshotInvalid, SnapshotItem
from checkpoint.snapshot_index import MAGIC, SnapshotIndex

pytestmark = pytest.mark.unit


def _grid(shape: tuple[int, ...], splits: tuple[int, ...]) -> list[ChunkStorageMetadata]:
    """`shape` cut into `splits[d]` near-equal pieces along each dim (FSDP's ceil rule),
    empty pieces included, as DCP lists a 2-D (dp x tp) sharded tensor's chunks."""
    per_dim = []
    for n, k in zip(shape, splits, strict=True):
        step = math.ceil(n / k)
        per_dim.append([(min(i * step, n), min((i + 1) * step, n) - min(i * step, n))
                        for i in range(k)])
    return [ChunkStorageMetadata(torch.Size([o for o, _ in pieces]),
                                 torch.Size([s for _, s in pieces]))
            for pieces in itertools.product(*per_dim)]


def _saved(shapes: dict[str, tuple[int, ...]], splits: dict[str, tuple[int, ...]]) -> Metadata:
    """Metadata as a snapshot's full save writes it: each chunk in a file of its own rank."""
    state: dict = {"state.progress.step": BytesStorageMetadata()}
    storage: dict = {MetadataIndex("state.progress.step"): SnapshotItem("bytes_0", 0, 40, None,
                                                                        ())}
    for fqn, shape in shapes.items():
        chunks = _grid(shape, splits[fqn])
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32,
                                                            requires_grad=True),
                                           torch.Size(shape), chunks)
        for i, c in enumerate(chunks):
            storage[MetadataIndex(fqn, c.offsets, i)] = SnapshotItem(
                f"shard_{i}", 64 + 8 * i, math.prod(c.sizes) * 4, "float32", tuple(c.sizes))
    return Metadata(state_dict_metadata=state, storage_data=storage)


SHAPES = {"state.w": (10, 6), "state.b": (7,), "state.s": ()}
SPLITS = {"state.w": (4, 2), "state.b": (4,), "state.s": ()}


def test_the_index_round_trips_the_metadata() -> None:
    saved = _saved(SHAPES, SPLITS)
    index = SnapshotIndex.parse(SnapshotIndex.of_metadata(saved).to_bytes(), "test")
    assert index.byte_items == {"state.progress.step": saved.storage_data[
        MetadataIndex("state.progress.step")]}
    for fqn, md in saved.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            continue
        everything = index.narrow(fqn, [ChunkStorageMetadata(torch.Size([0] * len(md.size)),
                                                             md.size)])
        assert [c for c, _, _ in everything] == md.chunks  # none of SHAPES' chunks is empty
        for _, key, item in everything:
            assert saved.storage_data[key] == item
    skeleton = index.skeleton()
    assert skeleton.state_dict_metadata.keys() == saved.state_dict_metadata.keys()
    assert skeleton.state_dict_metadata["state.w"].size == torch.Size([10, 6])
    assert skeleton.state_dict_metadata["state.w"].properties.requires_grad


@pytest.mark.parametrize("local_splits", [(3, 1), (1, 3), (2, 2), (5, 1), (1, 1)])
def test_narrowing_gives_dcp_the_reads_a_plan_over_every_chunk_gives(local_splits) -> None:
    saved = _saved(SHAPES, SPLITS)
    index = SnapshotIndex.parse(SnapshotIndex.of_metadata(saved).to_bytes(), "test")
    fqn = "state.w"
    full = saved.state_dict_metadata[fqn]
    for local in _grid((10, 6), local_splits):
        picked = index.narrow(fqn, [local])
        narrowed = dataclasses.replace(full, chunks=[c for c, _, _ in picked])
        assert create_read_items_for_chunk_list(fqn, narrowed, [local]) == \
            create_read_items_for_chunk_list(fqn, full, [local])
        # Exactly the saved chunks DCP reads from, one by one.
        assert [c for c, _, _ in picked] == [
            c for c in full.chunks if create_read_items_for_chunk_list(
                fqn, dataclasses.replace(full, chunks=[c]), [local])]


def _forge(change) -> bytes:
    """The index of SHAPES with `change(header, rows)` applied to its header (a dict) and its
    rows (one int64 array, all tensors'), serialised as the writer does."""
    blob = SnapshotIndex.of_metadata(_saved(SHAPES, SPLITS)).to_bytes()
    magic, length = struct.unpack_from("<8sQ", blob)
    header = json.loads(blob[16:16 + length])
    start = 16 + length + (-(16 + length) % 8)
    rows = np.frombuffer(blob, dtype="<i8", offset=start).copy()
    change(header, rows)
    raw = json.dumps(header).encode()
    head = struct.pack("<8sQ", magic, len(raw)) + raw
    return head + b"\0" * (-len(head) % 8) + rows.tobytes()


def _set(path: tuple, value):
    def change(header, rows):
        target = header
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _row(at: int, value: int):
    def change(header, rows):
        rows[at] = value
    return change


# (the damage, what the error says). Row 0 of state.w: offsets 0, 0; sizes 3, 3; file 1
# (file 0 is the byte item's), offset 64, length 36.
FORGED = {
    "empty": (lambda: b"", "too short"),
    "magic": (lambda: b"\x80\x04" + bytes(30), "not a snapshot index"),
    "header past end": (lambda: MAGIC + struct.pack("<Q", 1 << 40), "runs past its end"),
    "header not json": (lambda: MAGIC + struct.pack("<Q", 3) + b"{x}" + bytes(5), "not JSON"),
    "files missing": (lambda: _forge(lambda h, r: h.pop("files")), "field 'files'"),
    "files repeated": (lambda: _forge(_set(("files", 1), "bytes_0")), "distinct file names"),
    "tensor entry": (lambda: _forge(_set(("tensors", 0, 2), "yes")), "not [key, dtype"),
    "dtype": (lambda: _forge(_set(("tensors", 0, 1), "system")), "no torch dtype"),
    "huge size": (lambda: _forge(_set(("tensors", 0, 3), [1 << 61, 2])), "2**62 bytes"),
    "rows past end": (lambda: _forge(_set(("tensors", 0, 4), 99)), "run past the end"),
    "rows left over": (lambda: _forge(_set(("tensors", 2, 4), 0)), "after the last tensor"),
    "chunk outside": (lambda: _forge(_row(0, 8)), "lies outside its size"),
    "negative": (lambda: _forge(_row(2, -1)), "lies outside its size"),
    "file id": (lambda: _forge(_row(4, 50)), "names a file past"),
    "length": (lambda: _forge(_row(6, 35)), "not its elements'"),
    "repeated key": (lambda: _forge(_set(("bytes", 0, 0), "state.w")), "listed twice"),
    "byte item": (lambda: _forge(_set(("bytes", 0, 1), 99)), "a byte item is not"),
}


@pytest.mark.parametrize("case", FORGED)
def test_a_damaged_or_forged_index_is_refused_naming_what(case) -> None:
    make, says = FORGED[case]
    with pytest.raises(SnapshotInvalid, match="^snapshot step 3: file .metadata: .*" + re.escape(says)):
        SnapshotIndex.parse(make(), "snapshot step 3: file .metadata")


def test_items_must_lie_in_the_manifest_files() -> None:
    index = SnapshotIndex.of_metadata(_saved(SHAPES, SPLITS))
    sizes = {name: 1 << 20 for name in index.files}
    index.check_files(sizes, "here")
    with pytest.raises(SnapshotInvalid, match="file shard_3, which is not in the manifest"):
        index.check_files({k: v for k, v in sizes.items() if k != "shard_3"}, "here")
    with pytest.raises(SnapshotInvalid, match="a chunk of state.w lies past the end"):
        index.check_files({**sizes, "shard_1": 64 + 8 + 35}, "here")
    with pytest.raises(SnapshotInvalid, match="byte item state.progress.step lies past"):
        index.check_files({**sizes, "bytes_0": 39}, "here")
