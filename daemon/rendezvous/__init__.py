"""Plain torchrun on etcd v3: `torchrun --rdzv-backend ultrascale` (docs/torchrun.md).

`torchrun_handler` is the `torchrun.handlers` entry point (pyproject.toml). torch loads every
such entry point whenever its rendezvous package is imported, also for other backends, so this
module imports nothing heavy: the handler's modules load when a handler is created.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def _create(params: Any) -> Any:
    """torchrun's creator: a handler for `params`, or one line on stderr and exit 2 when a
    rendezvous option is bad."""
    from daemon.rendezvous.conf import RendezvousConfError
    from daemon.rendezvous.handler import create_rdzv_handler

    try:
        return create_rdzv_handler(params)
    except RendezvousConfError as exc:
        print(f"torchrun: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def torchrun_handler() -> Callable[[Any], Any]:
    """The `torchrun.handlers` entry point: torchrun calls it for the creator it registers."""
    return _create
