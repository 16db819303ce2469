"""SnapshotStore over real shared-memory files: completeness, retention, verified byte ranges."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from checkpoint.snapshot_format import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    METADATA_NAME,
    FileEntry,
    SnapshotInvalid,
    SnapshotManifest,
    checksum,
    chunk_checksums,
    read_held,
    record_name,
    shard_name,
    snapshot_root,
    step_dir,
    write_atomically,
)
from checkpoint.snapshot_store import SnapshotStore

SHM = Path("/dev/shm")


@pytest.fixture
def root():
    path = Path(tempfile.mkdtemp(dir=SHM, prefix="ultrascale-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_step(root: Path, step: int, sizes: list[int], *, manifest: bool = True,
              records: bool = True) -> dict[str, bytes]:
    """A snapshot as the writer lays it out: one shard per rank, .metadata, then the manifest."""
    directory = step_dir(root, step)
    directory.mkdir(parents=True)
    contents, entries = {}, []
    for rank, size in enumerate(sizes):
        data = os.urandom(size)
        (directory / shard_name(rank)).write_bytes(data)
        contents[shard_name(rank)] = data
        entry = FileEntry(shard_name(rank), rank, size, chunk_checksums(data))
        (directory / record_name(rank)).write_text(json.dumps({"step": step, **entry.to_json()}))
        # The writer's manifests leave shard checksums to each rank's record.
        entries.append(FileEntry(shard_name(rank), rank, size, None if records else entry.chunks))
    meta = os.urandom(300)
    (directory / METADATA_NAME).write_bytes(meta)
    entries.append(FileEntry(METADATA_NAME, 0, len(meta), chunk_checksums(meta)))
    if manifest:
        body = SnapshotManifest(step, step * 10, len(sizes), {"dp": len(sizes)}, tuple(entries))
        write_atomically(directory / MANIFEST_NAME, body.to_bytes())
    return contents


def test_lists_complete_steps_and_keeps_the_last_two(root):
    for step in (1, 2, 3, 4):
        make_step(root, step, [100, 200])
    make_step(root, 5, [100, 200], manifest=False)  # being written, or its writer died
    store = SnapshotStore(root)
    assert store.steps() == [1, 2, 3, 4]
    assert store.prune() == [1, 2]
    assert store.steps() == [3, 4]
    present = sorted(p.name for p in root.iterdir())
    assert present == ["step_00000003", "step_00000004", "step_00000005"]
    # Once step 6 completes, 3 goes, and so does 5: no save older than a complete one is running.
    make_step(root, 6, [100, 200])
    assert store.prune() == [3, 5]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006"]


def test_a_restore_discards_newer_steps_at_once_and_a_purge_removes_them(root):
    """`free_after` renames each newer step out of the steps' names: nothing lists, reads or
    restores it from then on; `purge_discarded` removes it later (the agent's keeper)."""
    for step in (4, 5, 6):
        make_step(root, step, [100, 200])
    store = SnapshotStore(root)
    assert store.free_after(4) == [5, 6]
    assert store.steps() == [4]
    assert not step_dir(root, 5).exists() and not step_dir(root, 6).exists()
    with pytest.raises(SnapshotInvalid):
        store.read(5, shard_name(0), 0, 10)
    assert read_held(root, 6, shard_name(0), 0, 10) is None
    assert len(store.discarded()) == 2
    # Step 5 trained again, in the new history, and replaced once more before any purge.
    make_step(root, 5, [100, 200])
    assert store.free_after(4) == [5]
    assert len(store.discarded()) == 3
    make_step(root, 5, [100, 200])  # and again: this one counts
    assert store.steps() == [4, 5]
    assert store.purge_discarded() == 3
    assert store.discarded() == []
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000005"]
    assert store.free_after(5) == [] and store.purge_discarded() == 0


def test_reads_verified_ranges_across_chunks(root):
    contents = make_step(root, 7, [2 * CHUNK_BYTES + 12345, 10])
    store = SnapshotStore(root)
    data = contents[shard_name(0)]
    for offset, length in [(0, 1), (CHUNK_BYTES - 3, 7), (5, 2 * CHUNK_BYTES), (0, len(data))]:
        assert store.read(7, shard_name(0), offset, length) == data[offset : offset + length]
    assert store.read(7, shard_name(0), CHUNK_BYTES, -1) == data[CHUNK_BYTES:]
    with pytest.raises(SnapshotInvalid, match="outside its"):
        store.read(7, shard_name(1), 5, 6)


def test_a_bit_flip_is_caught_in_the_chunk_it_hits(root):
    make_step(root, 3, [2 * CHUNK_BYTES, 64])
    path = step_dir(root, 3) / shard_name(0)
    with open(path, "r+b") as f:
        f.seek(CHUNK_BYTES + 17)
        byte = f.read(1)[0]
        f.seek(CHUNK_BYTES + 17)
        f.write(bytes([byte ^ 0x04]))
    store = SnapshotStore(root)
    assert store.read(3, shard_name(0), 0, 100)  # chunk 0 is intact
    expected = r"step 3: file rank_00000.distcp \(rank 0\): checksum mismatch in chunk 1"
    with pytest.raises(SnapshotInvalid, match=expected):
        store.read(3, shard_name(0), CHUNK_BYTES, 10)


def test_truncated_and_missing_shards(root):
    make_step(root, 4, [1000, 1000, 1000])
    directory = step_dir(root, 4)
    store = SnapshotStore(root)
    os.truncate(directory / shard_name(1), 500)
    (directory / shard_name(2)).unlink()
    assert store.steps() == []
    with pytest.raises(SnapshotInvalid, match=r"step 4: file rank_00001.distcp \(rank 1\) is truncated"):
        store.read(4, shard_name(1), 0, 1000)
    with pytest.raises(SnapshotInvalid, match=r"step 4: file rank_00002.distcp \(rank 2\) is missing"):
        store.read(4, shard_name(2), 0, 10)


def test_a_damaged_manifest_is_rejected_by_name(root):
    make_step(root, 2, [10])
    path = step_dir(root, 2) / MANIFEST_NAME
    raw = json.loads(path.read_bytes())
    raw["files"][0]["size"] = 11  # an edit without a new checksum
    path.write_text(json.dumps(raw))
    store = SnapshotStore(root)
    assert store.steps() == []
    with pytest.raises(SnapshotInvalid, match="field 'checksum'"):
        store.manifest(2)
    del raw["checksum"]
    raw["files"] = raw["files"][1:]  # a consistent checksum over a manifest missing a shard
    raw["checksum"] = checksum(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode())
    path.write_text(json.dumps(raw))
    with pytest.raises(SnapshotInvalid, match=r"field 'files' must hold one shard per rank 0..0"):
        store.manifest(2)


def test_root_naming():
    assert snapshot_root("llama-7b") == Path(f"/dev/shm/ultrascale-{os.geteuid()}/llama-7b")
    assert snapshot_root("llama-7b", Path("/run/ultrad")) == Path("/run/ultrad/llama-7b")
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="job name"):
            snapshot_root(bad)


def test_shard_checksums_in_the_manifest_itself_are_read_too(root):
    contents = make_step(root, 8, [CHUNK_BYTES + 5], records=False)
    (step_dir(root, 8) / record_name(0)).unlink()
    assert SnapshotStore(root).read(8, shard_name(0), 0, -1) == contents[shard_name(0)]


def test_a_shard_whose_record_is_missing_or_wrong_is_not_read(root):
    make_step(root, 9, [100, 100])
    directory = step_dir(root, 9)
    (directory / record_name(0)).unlink()
    store = SnapshotStore(root)
    assert store.steps() == []  # a shard is whole only once its record is written
    with pytest.raises(SnapshotInvalid, match="record is missing"):
        store.read(9, shard_name(0), 0, 10)
    raw = json.loads((directory / record_name(1)).read_text())
    raw["size"] = 99
    (directory / record_name(1)).write_text(json.dumps(raw))
    with pytest.raises(SnapshotInvalid, match="does not match the manifest"):
        store.read(9, shard_name(1), 0, 10)


def test_a_shard_over_2_gib_is_read_whole(tmp_path: Path):
    """One pread(2) returns at most 2 GiB - 4 KiB: a bigger shard (a 1B model's fp32 state is
    several GiB per rank) must still come back whole. A sparse file on disk, so the test costs
    one 2 GiB buffer and no 2 GiB of writing."""
    size = (2 << 30) + 8192
    directory = step_dir(tmp_path, 7)
    directory.mkdir(parents=True)
    with open(directory / shard_name(0), "wb") as f:
        f.write(b"head")
        f.truncate(size)
        f.seek(size - 4)
        f.write(b"end!")
    data = read_held(tmp_path, 7, shard_name(0), 0, -1)
    assert data is not None
    assert len(data) == size, len(data)  # not the bytes themselves: 2 GiB of repr
    assert data[:4] == b"head" and data[-4:] == b"end!"
    del data
    tail = read_held(tmp_path, 7, shard_name(0), size - 4, 100)  # past the end: what there is
    assert tail == b"end!"
