"""The snapshot writer's thread (trainer/writer_thread.py): calls run in the order handed over,
on the one named thread, off the caller's; a call's exception reaches whoever waits for it; and
closing runs what is still queued."""

from __future__ import annotations

import threading

import pytest

from trainer.writer_thread import WriterThread

pytestmark = pytest.mark.unit


def test_calls_run_in_order_on_the_named_thread_and_close_runs_what_is_queued():
    writer = WriterThread("unit-writer")
    release = threading.Event()
    ran: list[tuple[int, str]] = []

    def call(i: int):
        def run() -> None:
            if i == 0:
                assert release.wait(30), "the test never released the first call"
            ran.append((i, threading.current_thread().name))
        return run

    handoffs = [writer.submit(call(i)) for i in range(5)]
    assert ran == []  # the first is held: nothing ran on the caller's thread
    release.set()
    handoffs[2].wait()
    writer.close()  # the rest were queued: they run before the thread ends
    assert ran == [(i, "unit-writer") for i in range(5)]
    for handoff in handoffs:
        handoff.wait()


def test_an_exception_reaches_the_waiter_and_the_thread_goes_on():
    writer = WriterThread("unit-writer")

    def fails() -> None:
        raise OSError("no space left on device")

    failed = writer.submit(fails)
    after = writer.submit(lambda: None)
    with pytest.raises(OSError, match="no space left"):
        failed.wait()
    after.wait()
    writer.close()
