"""A standby worker waits, with torch imported, until its agent gives it a local rank.

The agent's supervisor starts it with ULTRA_LOCAL_RANK=standby and a pipe on stdin. When a local
rank needs a worker, the supervisor writes one JSON line: {"local_rank", "log", "error_file"}.
The standby then writes to that rank's log and error file and runs as that rank's worker, the
same from there on as one started for it. End of input (the agent stopped, or stopped it) means
it is not needed: it exits 0.
"""

from __future__ import annotations

import json
import os
import sys
from typing import BinaryIO

STANDBY = "standby"


def is_standby(env: dict[str, str] | os._Environ[str]) -> bool:
    return env.get("ULTRA_LOCAL_RANK", "") == STANDBY


def await_role(stdin: BinaryIO) -> int | None:
    """Block until the agent names this process's local rank; None at end of input.

    Points stdout and stderr at the rank's log and sets its environment (ULTRA_LOCAL_RANK,
    TORCHELASTIC_ERROR_FILE) before returning.
    """
    line = stdin.readline()
    if not line.strip():
        return None
    role = json.loads(line)
    rank = int(role["local_rank"])
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(role["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ["ULTRA_LOCAL_RANK"] = str(rank)
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(role["error_file"])
    return rank
