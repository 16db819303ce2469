"""Asking a worker for its stacks (daemon/node/stacks.py, trainer/stack_dump.py): a process that
answers, one that does not (bounded wait), a stopped one (no wait), and the file's creation."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from daemon.node.stacks import ask_stacks, open_stacks_file
from tests.conftest import REPO

pytestmark = pytest.mark.unit

ANSWERS = """
import time
import trainer.stack_dump  # arms SIGUSR1 on import, as in trainer.worker
def stuck_here():
    print("ready", flush=True)
    time.sleep(60)
stuck_here()
"""
IGNORES = """
import signal, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def child(tmp_path: Path) -> Iterator[tuple[Path, Callable[[str], subprocess.Popen[str]]]]:
    procs: list[subprocess.Popen[str]] = []
    path = tmp_path / "worker-0.stacks"

    def start(code: str) -> subprocess.Popen[str]:
        fd = open_stacks_file(path)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                pass_fds=(fd,), env={**os.environ, "PYTHONPATH": str(REPO),
                                     "ULTRA_STACKS_FD": str(fd)})
        finally:
            os.close(fd)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        return proc

    yield path, start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_process_in_python_answers_with_its_stacks(child) -> None:
    path, start = child
    proc = start(ANSWERS)
    stacks = asyncio.run(ask_stacks(proc.pid, path, stopped=False))
    assert "in stuck_here" in stacks and "Current thread" in stacks, stacks
    assert proc.poll() is None  # asking does not kill it
    again = asyncio.run(ask_stacks(proc.pid, path, stopped=False))
    # Only the new dump, not the file's earlier content. Not compared with the first: that one
    # may catch the child still returning from its print, a line above the sleep.
    assert again.count("Current thread") == 1 and "in stuck_here" in again, again


def test_a_process_that_does_not_answer_gets_a_note_within_the_bound(child) -> None:
    path, start = child
    proc = start(IGNORES)
    started = time.monotonic()
    note = asyncio.run(ask_stacks(proc.pid, path, stopped=False, wait=0.3))
    assert note == "no stacks: the worker did not answer within 0.3s"
    assert time.monotonic() - started < 0.3 + 0.5  # bounded (the rest: a loaded machine)


def test_a_stopped_process_is_not_waited_for(tmp_path: Path) -> None:
    path = tmp_path / "worker-0.stacks"
    os.close(open_stacks_file(path))
    started = time.monotonic()
    note = asyncio.run(ask_stacks(os.getpid(), path, stopped=True, wait=5.0))
    assert note == "no stacks: the worker is stopped (SIGSTOP) and cannot answer"
    assert time.monotonic() - started < 1.0


def test_the_stacks_file_is_new_private_and_never_follows_a_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    path = tmp_path / "worker-0.stacks"
    path.symlink_to(target)
    fd = open_stacks_file(path)
    os.write(fd, b"x")
    os.close(fd)
    assert target.read_text() == "keep"
    assert not path.is_symlink() and path.read_text() == "x"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
