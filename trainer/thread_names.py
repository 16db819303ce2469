"""The names `ps -o comm`, `top -H` and /proc/<pid>/task/<tid>/comm show for the worker's
process and threads (Linux PR_SET_NAME: 15 bytes; a no-op elsewhere)."""

from __future__ import annotations

import ctypes
import sys

PR_SET_NAME = 15

# The thread that writes a rank's snapshots off the step (trainer.snapshots).
SNAPSHOT_WRITER = "snapshot-write"


def name_thread(name: str) -> None:
    """Name the calling thread; named from the main thread, it is the process's name."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
