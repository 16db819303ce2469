"""tests/processes.py's Held: signals reach the processes held, and none once they are gone."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.processes import Held


def test_held_processes_are_signalled_and_known_gone() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    held = Held([sleeper.pid, quick.pid])
    try:
        quick.wait()  # exited and reaped: its number is free for anyone
        assert held.running() == [sleeper.pid]
        held.kill()  # the reaped one is skipped, not an error
        assert sleeper.wait(10) == -signal.SIGKILL
        assert held.running() == []
        held.kill(signal.SIGCONT)  # nothing left to reach: still no error
    finally:
        held.close()
        sleeper.kill()
        sleeper.wait()

