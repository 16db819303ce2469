"""The systemd notify protocol: one datagram per message to the socket in `$NOTIFY_SOCKET`.

Messages are newline-separated `KEY=VALUE` assignments (`READY=1`, `STATUS=...`, `WATCHDOG=1`,
`STOPPING=1`); see sd_notify(3). A socket name starting with `@` is in Linux's abstract
namespace (the `@` stands for a leading NUL byte). Without `$NOTIFY_SOCKET` (not started by
systemd with `Type=notify`) every call is a no-op, so the agent runs the same everywhere.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Notifier:
    address: str = ""  # the socket path, or "\0name" for an abstract socket; "": disabled
    watchdog_s: float = 0.0  # WATCHDOG_USEC in seconds; 0: systemd expects no WATCHDOG=1

    @classmethod
    def from_env(cls, env: Mapping[str, str], pid: int | None = None) -> Notifier:
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        watchdog_s = 0.0
        usec = env.get("WATCHDOG_USEC", "")
        # WATCHDOG_PID names the process systemd watches; a child that inherited the
        # variables (a worker) must not ping on its agent's behalf.
        owner = env.get("WATCHDOG_PID", "")
        if usec and (not owner or owner == str(os.getpid() if pid is None else pid)):
            try:
                watchdog_s = int(usec) / 1e6
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return cls(address, max(0.0, watchdog_s))

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *assignments: str) -> bool:
        """Send one message; False when disabled or the socket refused it (never raises:
        the service manager going away must not take the agent with it)."""
        if not self.address:
            return False
        message = "\n".join(assignments).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # Never block: a receiver that stopped reading (its queue holds only a few
                # datagrams) would otherwise stall the event loop, and with it the shutdown.
                sock.setblocking(False)
                sock.sendto(message, self.address)
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        # One line: a newline would start a new assignment.
        return self.send("STATUS=" + " ".join(status.split()))

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", "STATUS=" + " ".join(status.split()))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")
