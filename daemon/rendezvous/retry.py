"""Retrying the rendezvous' etcd calls while etcd does not answer (a member restarting, or
the client moving to the next member)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from daemon.control.etcd_client import ETCD_ERRORS

T = TypeVar("T")


class EtcdSilent(ConnectionError):
    """etcd did not answer for the whole retry window; the message says the last reason."""


@dataclass(frozen=True)
class Retry:
    seconds: float = 10.0
    first_pause: float = 0.1
    max_pause: float = 1.0

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()`, sent again with backoff while etcd does not answer, for up to `seconds`.

        Only for calls that are safe to send twice: a read, a put of the same value, or a
        compare-and-set whose repeat fails its compare if the first one was applied."""
        deadline = time.monotonic() + self.seconds
        pause = self.first_pause
        while True:
            try:
                return fn()
            except (*ETCD_ERRORS, TimeoutError) as exc:
                if time.monotonic() + pause > deadline:
                    raise EtcdSilent(f"etcd did not answer for {self.seconds:g}s: "
                                     f"{type(exc).__name__}: {str(exc)[:300]}") from exc
            time.sleep(pause)
            pause = min(pause * 2, self.max_pause)
