"""A worker's log line: time, node and local rank, to stderr (the agent's per-worker log)."""

from __future__ import annotations

import os
import sys
import time


def log(msg: str) -> None:
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"
    node, rank = os.environ.get("ULTRA_NODE_ID", "?"), os.environ.get("ULTRA_LOCAL_RANK", "?")
    print(f"{stamp} [worker {node}/{rank}] {msg}", file=sys.stderr, flush=True)
