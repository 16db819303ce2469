"""The notify protocol and the systemd watchdog, in-process, through a real datagram socket.

The watchdog runs against a real asyncio loop (in a thread) and the agent's real
TaskSupervisor; the loop is blocked for real (a callback that waits on a lock), and a
supervised task really dies. Only the half-period is short (50 ms) so the test is quick.
"""

from __future__ import annotations

import asyncio
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.liveness import LoopWatchdog
from daemon.sdnotify import Notifier
from daemon.tasks import TaskSupervisor

pytestmark = pytest.mark.unit

INTERVAL = 0.05
QUIET_WINDOW = 30 * INTERVAL  # long enough for many pings, were any sent


@pytest.fixture
def receiver() -> Iterator[tuple[socket.socket, str]]:
    # sun_path is short (107 bytes): a private dir under /tmp rather than pytest's tmp_path.
    with tempfile.TemporaryDirectory(prefix="sdn-") as d:
        path = str(Path(d) / "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        try:
            yield sock, path
        finally:
            sock.close()


def recv(sock: socket.socket, timeout: float) -> list[str]:
    sock.settimeout(timeout)
    try:
        return sock.recv(4096).decode().split("\n")
    except TimeoutError:
        return []


def drain(sock: socket.socket) -> list[list[str]]:
    out = []
    while message := recv(sock, 0.001):
        out.append(message)
    return out


def count_pings(sock: socket.socket, seconds: float) -> int:
    end, pings = time.monotonic() + seconds, 0
    while (left := end - time.monotonic()) > 0:
        pings += recv(sock, left) == ["WATCHDOG=1"]
    return pings


def wait_pings(sock: socket.socket, n: int, timeout: float = 30) -> None:
    end, pings = time.monotonic() + timeout, 0
    while pings < n:
        assert time.monotonic() < end, f"only {pings} WATCHDOG=1 within {timeout}s"
        pings += recv(sock, 1.0) == ["WATCHDOG=1"]


def test_from_env() -> None:
    assert not Notifier.from_env({}).enabled
    assert not Notifier.from_env({}).send("READY=1")
    n = Notifier.from_env({"NOTIFY_SOCKET": "@ultrad/x", "WATCHDOG_USEC": "4000000"}, pid=7)
    assert n.address == "\0ultrad/x" and n.watchdog_s == 4.0
    # The variables were meant for another process (we are its child): no watchdog.
    other = Notifier.from_env({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "4000000",
                               "WATCHDOG_PID": "8"}, pid=7)
    assert other.watchdog_s == 0 and other.enabled
    assert Notifier.from_env({"WATCHDOG_USEC": "soon"}).watchdog_s == 0


def test_messages_reach_a_path_socket(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    n = Notifier(path)
    assert n.ready("waiting: joined")
    ready = recv(sock, 5)
    assert ready[:2] == ["READY=1", "STATUS=waiting: joined"] and ready[2].startswith("MAINPID=")
    assert n.status("running:\nin generation 3")
    assert recv(sock, 5) == ["STATUS=running: in generation 3"]
    assert n.stopping("draining")
    assert recv(sock, 5) == ["STOPPING=1", "STATUS=draining"]


def test_a_receiver_that_stopped_reading_never_blocks_the_sender(
        receiver: tuple[socket.socket, str]) -> None:
    _, path = receiver
    n = Notifier(path)
    # Nobody reads: the queue fills after a few datagrams and the rest are dropped, at once.
    sent = [n.watchdog() for _ in range(200)]
    assert sent[0] and not all(sent)


def test_watchdog_only_while_the_loop_answers_and_no_task_died(
        receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    loop = asyncio.new_event_loop()
    tasks_box: list[TaskSupervisor] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)

        async def make() -> None:
            tasks_box.append(TaskSupervisor())
            tasks_box[0].spawn(asyncio.Event().wait(), "forever")

        loop.run_until_complete(make())
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    while not tasks_box:
        time.sleep(0.01)
    tasks = tasks_box[0]
    dog = LoopWatchdog(loop, lambda: not tasks.failed.is_set(), Notifier(path).watchdog,
                       INTERVAL)
    dog.start()
    gate, blocked = threading.Event(), threading.Event()
    try:
        wait_pings(sock, 3)  # healthy: pings come

        def block() -> None:  # a callback that never yields: the loop is stuck in it
            blocked.set()
            gate.wait()

        loop.call_soon_threadsafe(block)
        assert blocked.wait(30)
        drain(sock)
        # A question answered just before the block may still earn one ping; no more.
        assert count_pings(sock, QUIET_WINDOW) <= 1
        gate.set()
        wait_pings(sock, 3)  # responsive again: pings resume

        async def die() -> None:
            raise RuntimeError("a long-lived task died")

        loop.call_soon_threadsafe(lambda: tasks.spawn(die(), "victim"))
        end = time.monotonic() + 30
        while not tasks.failed.is_set():
            assert time.monotonic() < end, "the task never failed"
            time.sleep(0.01)
        drain(sock)
        assert count_pings(sock, QUIET_WINDOW) <= 1
        assert "victim" in tasks.failure
    finally:
        gate.set()
        dog.stop()

        async def close() -> None:
            await tasks.close()

        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
