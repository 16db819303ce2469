"""systemd's watchdog, fed only while the agent is really alive.

A thread sends `WATCHDOG=1` every half `WATCHDOG_USEC`, but only when the event loop answered
the thread's previous question within that half period, and its answer said that no
supervised task has died. The thread cannot be fooled by a loop that is blocked (a CPU-bound
callback, a deadlock on a lock) because the answer has to be computed *on* the loop; and a
loop that answers but lost a long-lived task (the membership keepalive, the leader, the view)
is not healthy either. systemd then kills and restarts the agent after `WatchdogSec`, and its
lease lapses so the others re-plan without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable


class LoopWatchdog:
    def __init__(self, loop: asyncio.AbstractEventLoop, healthy: Callable[[], bool],
                 ping: Callable[[], object], interval: float) -> None:
        self.loop = loop
        self.healthy = healthy  # runs on the loop
        self.ping = ping        # runs on the watchdog thread
        self.interval = interval
        self._stop = threading.Event()
        # (number of the last question answered, whether the agent was healthy then);
        # written by the loop, read by the thread: one tuple, replaced whole.
        self._answer: tuple[int, bool] = (0, False)
        self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 1)

    def _on_loop(self, question: int) -> None:
        self._answer = (question, bool(self.healthy()))

    def _run(self) -> None:
        asked = 0
        # Ask at once, so the first ping comes one interval after start.
        while not self._stop.is_set():
            asked += 1
            try:
                self.loop.call_soon_threadsafe(self._on_loop, asked)
            except RuntimeError:  # the loop is closed: the agent is gone
                return
            if self._stop.wait(self.interval):
                return
            answered, healthy = self._answer
            if answered == asked and healthy:
                with contextlib.suppress(Exception):
                    self.ping()
