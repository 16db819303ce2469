"""The c10d TCPStore of each generation, hosted by the agent the plan names (the leader).

A store outlives any worker, so a failing worker never takes the rendezvous down with it, and
a fresh port per generation keeps a straggler of the old generation from ever reaching the new
one (docs/architecture.md, "Generations"). torch is imported in a thread when the agent starts
(`preload`), so the first generation change does not wait for it.

Both the import and the store's start run in daemon threads, not in asyncio's default executor:
`asyncio.run` joins the executor's threads when the loop closes, so an agent told to stop
while torch was still importing (tens of seconds with many agents starting on one machine)
stayed alive, silent, until the import ended, and systemd or Kubernetes then SIGKILLed it.

c10d's TCPStore server listens on every interface, whatever host it is given; anyone who
reaches it reads and writes the rendezvous keys. So the agent binds the listening socket
itself, to the address it advertises (the one workers are told to dial), and hands it to the
store (`master_listen_fd`): with `--listen 127.0.0.1` the store is on loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def in_daemon_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """`fn()` in a daemon thread, as a future of the running loop; exit never waits for it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class StoreHost:
    """The stores of the last `keep` generations, and one spare started ahead of the next.

    Starting a store (a listening socket and c10d's server thread) took 4.6 ms of the leader's
    12 ms from a failure's decision to its generation written (`bench.recovery`). A spare
    started a while after each generation is written (`prepare_later`: once that generation's
    own start is over) takes that off the next recovery. The spare's port is handed to no one
    before its generation, so each generation still gets a port that no straggler of an older
    one has heard of.
    """

    def __init__(self, host: str, keep: int = 2) -> None:
        self.host = host
        self.keep = keep
        self._stores: dict[int, Any] = {}
        self._spare: asyncio.Future[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def prepare(self) -> None:
        """Start the spare store in the background (no-op when one is started or starting);
        a `prepare_later` pending is done with."""
        if self._timer is not None:
            self._timer.cancel()  # harmless when it is the timer's own call
            self._timer = None
        if self._spare is None:
            self._spare = in_daemon_thread(self._start, "store-spare")

    def prepare_later(self, delay_s: float) -> None:
        """`prepare` in `delay_s` seconds (a call pending already is kept)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(delay_s, self.prepare)

    async def open(self, generation: int) -> int:
        """Start the store of `generation` on a fresh port (the spare's, when one is ready or
        starting); returns the port."""
        spare, self._spare = self._spare, None
        store = None
        if spare is not None:
            # A spare that failed to start is replaced below, by a store started now.
            with contextlib.suppress(Exception):
                store = await spare
        if store is None:
            store = await in_daemon_thread(self._start, f"store-{generation}")
        self._stores[generation] = store
        # Keep the previous generation's store a while: its workers may still be leaving.
        for old in sorted(self._stores)[:-self.keep]:
            del self._stores[old]
        return int(store.port)

    @staticmethod
    async def preload() -> None:
        """Import torch.distributed (slow) ahead of the first generation."""
        await in_daemon_thread(_import_torch_distributed, "preload-torch")

    def _start(self) -> Any:
        from torch.distributed import TCPStore

        listener = bound_listener(self.host)
        try:
            port = listener.getsockname()[1]
            store = TCPStore(self.host, port, is_master=True, wait_for_workers=False,
                             master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store's server owns the descriptor now, and closes it
        return store

    def close(self) -> None:
        self._stores.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._spare is not None:
            # A spare still starting settles into the cancelled future and is dropped.
            self._spare.cancel()
            self._spare = None


def bound_listener(host: str) -> socket.socket:
    """A listening TCP socket on `host` (an address or a name, resolved here) and a free port."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise OSError(f"store host {host!r}: {exc.strerror}") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except BaseException:
        listener.close()
        raise
    return listener


def _import_torch_distributed() -> None:
    import torch.distributed  # noqa: F401
