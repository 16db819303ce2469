"""A worker dies with the agent that started it, armed before anything heavy is imported.

`trainer.worker` imports this module first. A worker, and above all the standby worker (started
while the node trains, to wait with torch imported), spends seconds in `import torch`; a node
whose agent is killed in those seconds must not leave it running, holding a device. So when the
process was started by an agent (ULTRA_AGENT_PID set), importing this module arms Linux's
PR_SET_PDEATHSIG at once, and exits if that agent is already gone.

Armed here rather than in a preexec_fn, which would make the agent fork() (see
daemon/node/supervisor.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_agent() -> None:
    """SIGKILL this process when its parent dies; exit now if the agent is already gone."""
    agent_pid = int(os.environ.get("ULTRA_AGENT_PID", "0"))
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if agent_pid and os.getppid() != agent_pid:
        raise SystemExit("the agent that started this worker is gone")


if os.environ.get("ULTRA_AGENT_PID"):
    die_with_agent()
