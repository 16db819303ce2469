"""The process that hosts an agent's c10d TCPStores: `python -m daemon.control.store_process`.

The agent itself never imports torch. Importing it holds the interpreter lock for most of a
second (loading libtorch; longer on a loaded machine), and an agent that did so in a thread
stalled its own event loop, and with it its RPCs and lease keep-alives, at the moment it first
led. Here the import runs in a process of its own, which the agent starts when it may need a
store (at its start when it runs workers, else when it first leads).

Requests come on stdin and replies go to stdout, one JSON object a line:

- `{"seq": n, "start": host}`: start a store listening on `host` (an address or a name) and a
  free port; the reply is `{"seq": n, "id": i, "port": p}` or `{"seq": n, "error": text}`;
- `{"close": i}`: stop store `i` (no reply).

The process ends when stdin closes or its parent dies (it is started with `parent_death_env`).
It names itself `ultra-store` (`ps -o comm`, `top`).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import IO, Any

from daemon.control.store_host import bound_listener
from daemon.procutil import arm_parent_death

_PR_SET_NAME = 15


def start_store(host: str) -> Any:
    """A c10d TCPStore server on `host` and a free port, listening there only: the socket is
    bound here and handed to the store (`master_listen_fd`), since the store's own listener
    would take every interface whatever host it is given."""
    from torch.distributed import TCPStore

    listener = bound_listener(host)
    try:
        port = listener.getsockname()[1]
        store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                         master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the descriptor now, and closes it
    return store


def serve(requests: IO[str], replies: IO[str]) -> None:
    """Answer `requests` until they end."""
    stores: dict[int, Any] = {}
    made = 0
    for line in requests:
        request = json.loads(line)
        if "close" in request:
            stores.pop(int(request["close"]), None)  # a dropped store stops its server
            continue
        reply: dict[str, Any] = {"seq": request["seq"]}
        try:
            store = start_store(str(request["start"]))
        except Exception as exc:  # noqa: BLE001 - the agent raises it, with this text
            reply["error"] = f"{type(exc).__name__}: {exc}"
        else:
            made += 1
            stores[made] = store
            reply |= {"id": made, "port": int(store.port)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> None:
    arm_parent_death()
    if sys.platform.startswith("linux"):  # what `ps -o comm` and top show (PR_SET_NAME)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, b"ultra-store", 0, 0, 0)
    # Replies get a descriptor of their own; whatever else writes to stdout (torch, a C
    # library) goes to stderr, the agent's log, and can never be read as a reply.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import torch.distributed  # noqa: F401 - the slow part, before the first request

    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
