"""The checkpoint manifest: commit, verification naming the broken file, fallback, retention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointInvalid,
    Manifest,
    apply_retention,
    checkpoint_dir,
    committed_steps,
    latest_valid,
    list_checkpoints,
    prune_fragments,
    read_manifest,
    verify,
    write_manifest,
)

pytestmark = pytest.mark.unit

LAYOUT = {"dp": 4, "tp": 1, "pp": 1, "cp": 1, "zero": 3}
SHARD = "__1_0.distcp"


def fake_dcp_checkpoint(root: Path, step: int, *, commit: bool = True) -> Path:
    """A directory shaped like a 2-rank DCP save; committed with a manifest unless told not to."""
    path = checkpoint_dir(root, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"metadata-%d" % step)
    for rank in range(2):
        (path / f"__{rank}_0.distcp").write_bytes(bytes([rank, step % 256]) * 3000)
    if commit:
        write_manifest(path, step=step, consumed_samples=8 * step, layout=LAYOUT)
    return path


def rewrite_manifest(path: Path, edit) -> None:
    doc = json.loads((path / MANIFEST_NAME).read_text())
    edit(doc)
    (path / MANIFEST_NAME).write_text(json.dumps(doc))


def test_round_trip(tmp_path: Path) -> None:
    path = checkpoint_dir(tmp_path, 12)
    path.mkdir()
    (path / ".metadata").write_bytes(b"meta")
    (path / "sub").mkdir()
    (path / "sub" / "extra.bin").write_bytes(b"\x00" * 5)
    write_manifest(path, step=12, consumed_samples=96, layout=LAYOUT, extra={"rng": "ok"})

    manifest = verify(path)

    assert isinstance(manifest, Manifest)
    assert (manifest.step, manifest.consumed_samples) == (12, 96)
    assert manifest.layout == LAYOUT and manifest.extra == {"rng": "ok"}
    assert [(f.path, f.size) for f in manifest.files] == [(".metadata", 4), ("sub/extra.bin", 5)]
    assert manifest.total_bytes == 9
    assert read_manifest(path) == manifest


def test_write_is_atomic_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = fake_dcp_checkpoint(tmp_path, 3)
    # A temp file a crashed writer left behind is not checkpoint data.
    (path / ".metadata.tmp").write_bytes(b"half")
    write_manifest(path, step=3, consumed_samples=24, layout=LAYOUT)

    names = sorted(p.name for p in path.iterdir())
    assert names == [".metadata", ".metadata.tmp", "__0_0.distcp", "__1_0.distcp", MANIFEST_NAME]
    assert ".metadata.tmp" not in [f.path for f in verify(path).files]


def test_failed_write_leaves_no_temp_and_no_manifest(tmp_path: Path) -> None:
    path = fake_dcp_checkpoint(tmp_path, 3, commit=False)
    with pytest.raises(TypeError):
        write_manifest(path, step=3, consumed_samples=0, layout={"dp": object()})
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_truncated_shard_is_a_size_mismatch_naming_the_file(tmp_path: Path) -> None:
    path = fake_dcp_checkpoint(tmp_path, 12)
    with open(path / SHARD, "r+b") as f:
        f.truncate(1234)

    with pytest.raises(CheckpointInvalid, match=r"^step_00000012/__1_0\.distcp: size 1234 != 6000"):
        verify(path, checksums=False)


def test_flipped_byte_is_a_checksum_mismatch_naming_the_file(tmp_path: Path) -> None:
    path = fake_dcp_checkpoint(tmp_path, 12)
    data = bytearray((path / SHARD).read_bytes())
    data[100] ^= 0xFF
    (path / SHARD).write_bytes(bytes(data))

    verify(path, checksums=False)  # same size: only the checksum can tell
    with pytest.raises(CheckpointInvalid, match=r"^checksum mismatch in step_00000012/__1_0\.dis"):
        verify(path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    path = fake_dcp_checkpoint(tmp_path, 12)
    (path / SHARD).unlink()
    with pytest.raises(CheckpointInvalid, match=r"^step_00000012/__1_0\.distcp: file missing"):
        verify(path)


def test_without_manifest_it_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = fake_dcp_checkpoint(tmp_path, 12)
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointInvalid, match=r"step_00000012/manifest.json: manifest missing"):
        verify(path)
    assert latest_valid(tmp_path, on_skip=lambda _: None) is None


def test_step_in_manifest_must_match_directory(tmp_path: Path) -> None:
    path = fake_dcp_checkpoint(tmp_path, 12)
    rewrite_manifest(path, lambda doc: doc.update(step=13))
    with pytest.raises(CheckpointInvalid, match=r"step 13 in manifest != 12 in directory name"):
        verify(path)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda doc: doc.pop("consumed_samples"), "'consumed_samples' is missing"),
        (lambda doc: doc.update(step="12"), "'step' must be int"),
        (lambda doc: doc.update(step=True), "'step' must be a non-negative integer"),
        (lambda doc: doc.update(layout=[]), "'layout' must be dict"),
        (lambda doc: doc["files"][1].update(size=-1), r"'files\[1\]\.size' must be a non-neg"),
        (lambda doc: doc["files"][2].pop("crc32c"), r"'files\[2\]\.crc32c' is missing"),
        (lambda doc: doc["files"][0].update(path="../x"), r"'files\[0\]\.path' must be a plain"),
        (lambda doc: doc.update(version=99), "'version' is 99"),
    ],
)
def test_malformed_manifest_names_the_field(tmp_path: Path, edit, field: str) -> None:
    path = fake_dcp_checkpoint(tmp_path, 12)
    rewrite_manifest(path, edit)
    where = "step_00000012/manifest.json"
    with pytest.raises(CheckpointInvalid, match=f"^{where}: malformed manifest: field {field}"):
        verify(path)


def test_manifest_that_is_not_json_is_malformed(tmp_path: Path) -> None:
    path = fake_dcp_checkpoint(tmp_path, 12)
    (path / MANIFEST_NAME).write_text('{"step": 12,')
    with pytest.raises(CheckpointInvalid, match="malformed manifest: not valid JSON"):
        verify(path)


def test_list_checkpoints_newest_first_and_only_step_dirs(tmp_path: Path) -> None:
    for step in (5, 20, 10):
        fake_dcp_checkpoint(tmp_path, step, commit=step != 20)
    (tmp_path / "step_7").mkdir()  # not the 8-digit spelling
    (tmp_path / "notes").mkdir()
    (tmp_path / "step_00000030").write_text("a file, not a directory")

    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 10, 5]
    assert list_checkpoints(tmp_path / "absent") == []


def test_latest_valid_falls_back_and_says_why(tmp_path: Path) -> None:
    fake_dcp_checkpoint(tmp_path, 6)
    newest = fake_dcp_checkpoint(tmp_path, 12)
    fake_dcp_checkpoint(tmp_path, 18, commit=False)  # a save that never committed
    data = bytearray((newest / SHARD).read_bytes())
    data[0] ^= 1
    (newest / SHARD).write_bytes(bytes(data))
    skipped: list[str] = []

    found = latest_valid(tmp_path, on_skip=skipped.append)

    assert found is not None
    manifest, path = found
    assert (manifest.step, path.name) == (6, "step_00000006")
    assert skipped == [
        "checkpoint step_00000018 is invalid (step_00000018/manifest.json: manifest missing "
        "(not a checkpoint)); trying an older one",
        "checkpoint step_00000012 is invalid (checksum mismatch in step_00000012/__1_0.distcp); "
        "trying an older one",
    ]


def test_retention_keeps_newest_valid_and_spares_a_save_in_progress(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        fake_dcp_checkpoint(tmp_path, step)
    with open(checkpoint_dir(tmp_path, 4) / SHARD, "r+b") as f:
        f.truncate(10)  # broken and older than the newest valid one: goes
    fake_dcp_checkpoint(tmp_path, 6, commit=False)  # newer than every valid one: may be writing

    removed = apply_retention(tmp_path, keep=2)

    assert [p.name for p in removed] == ["step_00000004", "step_00000002", "step_00000001"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 5, 3]
    verify(checkpoint_dir(tmp_path, 5))
    verify(checkpoint_dir(tmp_path, 3))


def test_retention_with_nothing_valid_removes_nothing(tmp_path: Path) -> None:
    fake_dcp_checkpoint(tmp_path, 1, commit=False)
    fake_dcp_checkpoint(tmp_path, 2, commit=False)
    assert apply_retention(tmp_path, keep=1) == []
    assert len(list_checkpoints(tmp_path)) == 2
    with pytest.raises(ValueError, match="keep must be >= 1"):
        apply_retention(tmp_path, keep=0)


def test_committed_steps_are_those_with_a_manifest_that_reads(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        fake_dcp_checkpoint(tmp_path, step, commit=step != 2)
    (checkpoint_dir(tmp_path, 4) / MANIFEST_NAME).write_text("{")  # torn: not committed
    with open(checkpoint_dir(tmp_path, 3) / SHARD, "r+b") as f:
        f.truncate(10)  # committed; its files are the restore's to check
    assert committed_steps(tmp_path) == [3, 1]
    assert committed_steps(tmp_path / "absent") == []


def _fragment(root: Path, step: int) -> None:
    """A node-local step directory on a node other than rank 0's: its shard, no manifest."""
    checkpoint_dir(root, step).mkdir(parents=True)
    (checkpoint_dir(root, step) / SHARD).write_bytes(b"shard")


def test_fragments_keep_the_newest_committed_and_what_is_newer(tmp_path: Path) -> None:
    for step in range(1, 7):
        _fragment(tmp_path, step)

    removed = prune_fragments(tmp_path, 2, committed=[1, 3, 5])

    # 5 and 3 are the newest two committed; 1 is committed but beyond keep; 2 and 4 are failed
    # saves older than the newest commit; 6 is newer than every commit: it may be a save's.
    assert [p.name for p in removed] == ["step_00000004", "step_00000002", "step_00000001"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 5, 3]


def test_failed_saves_never_cost_a_node_its_last_committed_fragment(tmp_path: Path) -> None:
    _fragment(tmp_path, 1)
    for failed in (2, 3, 4):  # saves whose manifest rank 0 never wrote: 1 stays committed
        _fragment(tmp_path, failed)
        assert prune_fragments(tmp_path, 1, committed=[1]) == []
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 3, 2, 1]
    assert prune_fragments(tmp_path, 1, committed=[]) == []  # nothing committed: nothing goes
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_fragments(tmp_path, 0, committed=[1])


def test_version_1_sha256_manifest_still_verifies(tmp_path: Path) -> None:
    import hashlib

    path = fake_dcp_checkpoint(tmp_path, 12)

    def as_version_1(doc: dict) -> None:
        # What an earlier build wrote: no "checksum" section, one sha256 per file.
        del doc["checksum"]
        doc["version"] = 1
        for f in doc["files"]:
            del f["crc32c"]
            f["sha256"] = hashlib.sha256((path / f["path"]).read_bytes()).hexdigest()

    rewrite_manifest(path, as_version_1)
    assert "checksum" not in json.loads((path / MANIFEST_NAME).read_text())
    manifest = verify(path)
    assert (manifest.version, manifest.scheme.algorithm) == (1, "sha256")
    data = bytearray((path / SHARD).read_bytes())
    data[-1] ^= 1
    (path / SHARD).write_bytes(bytes(data))
    with pytest.raises(CheckpointInvalid, match=r"^checksum mismatch in step_00000012/__1_0\.distcp$"):
        verify(path)


def test_blocks_name_where_the_damage_is(tmp_path: Path) -> None:
    from checkpoint.checksum import CRC32C, Scheme

    path = fake_dcp_checkpoint(tmp_path, 12, commit=False)
    write_manifest(path, step=12, consumed_samples=0, layout=LAYOUT, scheme=Scheme(CRC32C, 1024))
    assert [len(f.digests) for f in verify(path).files] == [1, 6, 6]
    with open(path / SHARD, "r+b") as f:
        f.seek(5000)
        f.write(b"\xff")
    with pytest.raises(CheckpointInvalid, match=r"__1_0\.distcp \(block 4, bytes 4096-5120\)$"):
        verify(path)


def test_reported_checksums_are_checked_against_sizes_and_leave_out_stale_files(
    tmp_path: Path,
) -> None:
    from checkpoint.manifest import FileEntry

    path = fake_dcp_checkpoint(tmp_path, 12, commit=False)
    entries = _entries(path)
    wrong_size = [e for e in entries if e.path != SHARD] + [FileEntry(SHARD, 5, ("00000000",))]
    with pytest.raises(CheckpointInvalid, match=r"__1_0\.distcp: size 6000 != 5 in manifest"):
        write_manifest(path, step=12, consumed_samples=0, layout=LAYOUT, files=wrong_size)
    assert not (path / MANIFEST_NAME).exists()
    # A file from an earlier save into the same directory, which this save did not write.
    (path / "__3_0.distcp").write_bytes(b"stale")
    write_manifest(path, step=12, consumed_samples=0, layout=LAYOUT, files=entries)
    assert verify(path).files == tuple(entries)


def _entries(path: Path) -> list:
    """Entries computed the way a tool would, from the bytes on disk."""
    from checkpoint.checksum import CURRENT, digest_stream
    from checkpoint.manifest import FileEntry

    out = []
    for name in sorted(p.name for p in path.iterdir() if p.name != MANIFEST_NAME):
        with open(path / name, "rb") as f:
            out.append(FileEntry(name, *digest_stream(f, CURRENT)))
    return out
