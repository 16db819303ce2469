"""Workers' log files: private, rotated when over their cap, read in bounded tails, followed
across a rotation, and never through a symlink."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from daemon.node import worker_logs
from daemon.node.worker_logs import LogNotFound, follow, log_path, open_log, tail

pytestmark = pytest.mark.unit


def test_open_log_is_private_and_rotates_over_its_cap(tmp_path: Path) -> None:
    path = log_path(tmp_path, "0")
    assert path == tmp_path / "worker-0.log"
    fd = open_log(path, max_bytes=10)
    os.write(fd, b"first run, more than ten bytes\n")
    os.close(fd)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    fd = open_log(path, max_bytes=10)  # over the cap: the old file becomes worker-0.log.1
    os.write(fd, b"second\n")
    os.close(fd)
    assert path.read_bytes() == b"second\n"
    assert (tmp_path / "worker-0.log.1").read_bytes() == b"first run, more than ten bytes\n"
    fd = open_log(path, max_bytes=100)  # under: appended
    os.write(fd, b"third\n")
    os.close(fd)
    assert path.read_bytes() == b"second\nthird\n"


def test_tail_sends_the_last_whole_lines(tmp_path: Path) -> None:
    path = log_path(tmp_path, "1")
    path.write_bytes(b"".join(f"line {i}\n".encode() for i in range(300)) + b"partial")
    data, offset = tail(path, 3)
    assert data == b"line 297\nline 298\nline 299\n"
    assert offset == path.stat().st_size - len(b"partial")  # the partial line comes later
    assert tail(path, 0)[0].count(b"\n") == worker_logs.DEFAULT_TAIL_LINES
    assert tail(path, 10**9)[0].count(b"\n") == 300


def test_tail_reads_at_most_its_byte_bound(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(worker_logs, "MAX_TAIL_BYTES", 20)
    path = log_path(tmp_path, "0")
    path.write_bytes(b"0123456789\nabcdefghij\nklmnopqrst\n")
    data, offset = tail(path, 100)
    # The last 20 bytes start inside "abcdefghij": that cut line is dropped.
    assert data == b"klmnopqrst\n" and offset == path.stat().st_size


def test_a_symlink_or_missing_log_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("not a log\n")
    (tmp_path / "worker-0.log").symlink_to(secret)
    with pytest.raises(LogNotFound, match="cannot read worker-0.log"):
        tail(log_path(tmp_path, "0"), 10)
    with pytest.raises(LogNotFound, match="no log worker-1.log on this node"):
        tail(log_path(tmp_path, "1"), 10)
    with pytest.raises(OSError):
        open_log(log_path(tmp_path, "0"))


def test_follow_streams_new_lines_and_the_next_file_after_a_rotation(tmp_path: Path) -> None:
    path = log_path(tmp_path, "0")
    path.write_bytes(b"old\n")
    _, offset = tail(path, 10)

    async def run() -> list[bytes]:
        got: list[bytes] = []
        done = asyncio.Event()

        async def reader() -> None:
            async for chunk in follow(path, offset, done.is_set):
                got.append(chunk)
                if b"after\n" in b"".join(got):
                    done.set()

        task = asyncio.create_task(reader())
        with path.open("ab") as f:
            f.write(b"new li")
            f.flush()
            await asyncio.sleep(3 * worker_logs.POLL_S)
            f.write(b"ne\n")
        await asyncio.sleep(3 * worker_logs.POLL_S)
        os.replace(path, path.with_name("worker-0.log.1"))
        path.write_bytes(b"after\n")
        await asyncio.wait_for(task, 10)
        return got

    assert b"".join(asyncio.run(run())) == b"new line\nafter\n"
