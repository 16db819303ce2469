"""The worker's heartbeat: a daemon thread telling the agent, about every second, what it does.

The agent kills a worker whose heartbeats stop (the process is stopped, or a thread holds the
interpreter lock), and picks the progress deadline from the phase. The thread runs while the
main thread waits in a collective: gloo and nccl waits release the interpreter lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

PHASES = ("idle", "join", "restore", "step", "checkpoint")
# Send failures are expected while the agent restarts or is busy: say so at most this often.
LOG_EVERY_S = 30.0

Send = Callable[[int, str, int, float], None]  # (generation, phase, step, deadline seconds)


class Heartbeat:
    """Beats `send(generation, phase, step, deadline)` every `interval_s` until stopped.

    The main thread calls `update` at every transition; the state is one tuple, replaced at
    once, so the thread never sends a phase with another phase's generation. A new phase is
    sent at once (the agent's deadline changes with it), a new step with the next beat.
    """

    def __init__(self, send: Send, log: Callable[[str], None], interval_s: float = 1.0) -> None:
        self._send, self._log, self.interval_s = send, log, interval_s
        self._state: tuple[int, str, int] = (0, "idle", 0)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._failures = 0
        self._last_log = -LOG_EVERY_S

    def update(self, generation: int, phase: str, step: int) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r} (known: {', '.join(PHASES)})")
        previous, self._state = self._state, (generation, phase, step)
        if previous[:2] != (generation, phase):
            self._wake.set()

    def phase(self, phase: str) -> None:
        generation, _, step = self._state
        self.update(generation, phase, step)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2 * self.interval_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            generation, phase, step = self._state
            try:
                # A beat that cannot arrive within the interval is stale by the next one.
                self._send(generation, phase, step, self.interval_s)
            except Exception as exc:  # noqa: BLE001 - a lost beat must never end the worker
                self._failures += 1
                now = time.monotonic()
                if now - self._last_log >= LOG_EVERY_S:
                    self._last_log = now
                    self._log(f"heartbeat failed ({self._failures} so far): {exc}")
            self._wake.wait(self.interval_s)
