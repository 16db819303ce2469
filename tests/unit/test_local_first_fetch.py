"""local_first_fetch: this node's shared memory first, the agent for the rest, in one call."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from checkpoint.snapshot_format import MANIFEST_NAME, SnapshotInvalid, shard_name, step_dir
from checkpoint.snapshot_reader import Range, local_first_fetch

pytestmark = pytest.mark.unit


def _remote(calls: list[list[Range]]):
    def fetch(ranges: Sequence[Range]) -> list[bytes]:
        calls.append(list(ranges))
        return [f"from the agent: {r.file}".encode() for r in ranges]
    return fetch


def test_reads_local_files_and_asks_the_agent_for_the_rest_in_one_call(tmp_path: Path):
    directory = step_dir(tmp_path, 7)
    directory.mkdir(parents=True)
    (directory / shard_name(0)).write_bytes(b"0123456789")
    calls: list[list[Range]] = []
    fetch = local_first_fetch(tmp_path, 7, _remote(calls))
    assert fetch([Range(shard_name(0), 2, 3), Range(shard_name(0), 4, -1)]) == [b"234", b"456789"]
    assert calls == []
    asked = [Range(shard_name(1), 0, 5), Range(shard_name(0), 0, 1), Range(MANIFEST_NAME, 0, -1)]
    assert fetch(asked) == [b"from the agent: " + shard_name(1).encode(), b"0",
                            b"from the agent: manifest.json"]
    assert calls == [[Range(shard_name(1), 0, 5), Range(MANIFEST_NAME, 0, -1)]]


def test_other_steps_are_not_read_locally(tmp_path: Path):
    step_dir(tmp_path, 6).mkdir(parents=True)
    (step_dir(tmp_path, 6) / shard_name(0)).write_bytes(b"old")
    calls: list[list[Range]] = []
    assert local_first_fetch(tmp_path, 7, _remote(calls))([Range(shard_name(0), 0, -1)]) == \
        [b"from the agent: " + shard_name(0).encode()]
    assert calls == [[Range(shard_name(0), 0, -1)]]


@pytest.mark.parametrize("name", ["../secret", "notes.txt", ""])
def test_refuses_names_that_are_not_snapshot_files(tmp_path: Path, name: str):
    calls: list[list[Range]] = []
    with pytest.raises(SnapshotInvalid, match="not a snapshot file name"):
        local_first_fetch(tmp_path, 7, _remote(calls))([Range(name, 0, -1)])
    assert calls == []
