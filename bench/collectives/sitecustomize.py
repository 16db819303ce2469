"""Counts a training process's torch.distributed collectives (bench.overhead, and a test).

Active when $ULTRA_COUNT_COLLECTIVES names a directory, this directory is on PYTHONPATH ahead
of site-packages (Python imports `sitecustomize` at start-up) and the process runs the trainer
(`-m trainer...`): agents and launchers are left alone. Every call of a public collective of
`torch.distributed` (as the trainer calls them: `dist.<name>(...)`) adds one to its name's
count, and the counts are rewritten to `<dir>/<pid>.json` at once (a worker may leave with
os._exit), through a temporary file renamed over it: a reader finds the previous count or the
new one, never a file cut short (a process killed between a truncation and its write left one
empty for good). A standby worker (ULTRA_LOCAL_RANK=standby) writes `<dir>/<pid>.standby.json`
instead: its warm-up trains a step in a world of its own (trainer/warm_up.py), which is no
training rank's step, so `bench.overhead` leaves those files out (the bench adopts no standby).
Never imported by the product.
"""

from __future__ import annotations

import os
import sys

_OUT = os.environ.get("ULTRA_COUNT_COLLECTIVES")

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "irecv", "isend", "monitored_barrier", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
)


def _install(out: str) -> None:
    import functools
    import json

    import torch.distributed as dist

    counts: dict[str, int] = {}
    role = ".standby" if os.environ.get("ULTRA_LOCAL_RANK") == "standby" else ""
    path = os.path.join(out, f"{os.getpid()}{role}.json")
    scratch = f"{path}.tmp"  # not `*.json`: readers glob for those

    def counted(name: str, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            with open(scratch, "w") as f:
                json.dump(counts, f)
            os.replace(scratch, path)
            return fn(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))


if _OUT and any(arg == "trainer" or arg.startswith("trainer.") for arg in sys.orig_argv):
    _install(_OUT)
