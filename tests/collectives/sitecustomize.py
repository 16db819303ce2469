"""Counts this process's torch.distributed collectives, for tests that compare step paths.

Active only when $ULTRA_TEST_COLLECTIVES names a directory and this directory is first on
PYTHONPATH (Python imports `sitecustomize` at start-up). Every call of a public collective of
`torch.distributed` (as the code under test calls it: `dist.<name>(...)`) adds one to its
name's count, and the counts are rewritten to `<dir>/<pid>.json` at once (a worker may leave
with os._exit). Never imported by the product.
"""

from __future__ import annotations

import os

_OUT = os.environ.get("ULTRA_TEST_COLLECTIVES")

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
    path = os.path.join(out, f"{os.getpid()}.json")

    def counted(name: str, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            with open(path, "w") as f:
                json.dump(counts, f)
            return fn(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))


if _OUT:
    _install(_OUT)
