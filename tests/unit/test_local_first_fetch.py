"""local_first_fetch: this node's shared memory first, the agent for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoint.snapshot_format import MANIFEST_NAME, SnapshotInvalid, shard_name, step_dir
from checkpoint.snapshot_reader import local_first_fetch

pytestmark = pytest.mark.unit


def _remote(calls: list[tuple[str, int, int]]):
    def fetch(file: str, offset: int, length: int) -> bytes:
        calls.append((file, offset, length))
        return b"from the agent"
    return fetch


def test_reads_local_files_and_asks_the_agent_for_the_rest(tmp_path: Path):
    directory = step_dir(tmp_path, 7)
    directory.mkdir(parents=True)
    (directory / shard_name(0)).write_bytes(b"0123456789")
    calls: list[tuple[str, int, int]] = []
    fetch = local_first_fetch(tmp_path, 7, _remote(calls))
    assert fetch(shard_name(0), 2, 3) == b"234"
    assert fetch(shard_name(0), 4, -1) == b"456789"
    assert calls == []
    assert fetch(shard_name(1), 0, 5) == b"from the agent"
    assert fetch(MANIFEST_NAME, 0, -1) == b"from the agent"
    assert calls == [(shard_name(1), 0, 5), (MANIFEST_NAME, 0, -1)]


def test_other_steps_are_not_read_locally(tmp_path: Path):
    step_dir(tmp_path, 6).mkdir(parents=True)
    (step_dir(tmp_path, 6) / shard_name(0)).write_bytes(b"old")
    calls: list[tuple[str, int, int]] = []
    assert local_first_fetch(tmp_path, 7, _remote(calls))(shard_name(0), 0, -1) == \
        b"from the agent"
    assert calls == [(shard_name(0), 0, -1)]


@pytest.mark.parametrize("name", ["../secret", "notes.txt", ""])
def test_refuses_names_that_are_not_snapshot_files(tmp_path: Path, name: str):
    calls: list[tuple[str, int, int]] = []
    with pytest.raises(SnapshotInvalid, match="not a snapshot file name"):
        local_first_fetch(tmp_path, 7, _remote(calls))(name, 0, -1)
    assert calls == []
