"""The c10d TCPStore of each generation, hosted by the agent the plan names (the leader).

A store outlives any worker, so a failing worker never takes the rendezvous down with it, and
a fresh port per generation keeps a straggler of the old generation from ever reaching the new
one (docs/architecture.md, "Generations").

The stores live in a child process of the agent (`daemon/control/store_process.py`), the only
part of an agent that imports torch. Importing it in the agent, even in a thread, held the
interpreter lock for most of a second (loading libtorch) and stalled the agent's event loop:
a control-plane-only agent that became leader answered no RPC for up to 0.9 s on a loaded
machine. The process is started ahead of need (`preload`: at the agent's start when it runs
workers, else when it first leads), so the first generation change does not wait for torch.
An agent told to stop while it is importing exits at once; the process dies with it.

c10d's TCPStore server listens on every interface, whatever host it is given; anyone who
reaches it reads and writes the rendezvous keys. So the store process binds the listening
socket itself, to the address the agent advertises (the one workers are told to dial), and
hands it to the store (`master_listen_fd`): with `--listen 127.0.0.1` the store is on loopback
only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any

from daemon.procutil import parent_death_env

log = logging.getLogger(__name__)


class StoreProcessError(RuntimeError):
    """The store process could not start a store, or exited."""


@dataclass(frozen=True)
class Store:
    """A store the store process runs: its id there and its port."""

    id: int
    port: int


class StoreProcess:
    """The child process that hosts the stores, and the requests in flight to it.

    Requests are written from any thread; one reader thread hands each reply to the future of
    its request. A store whose request was cancelled meanwhile is closed as soon as it is
    made, so nothing the agent no longer waits for stays open."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.control.store_process"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, **parent_death_env()})
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[str] = self._proc.stdin
        self._write_lock = threading.Lock()
        self._waiting: dict[int, concurrent.futures.Future[Store]] = {}
        self._seq = itertools.count(1)
        self._ended: StoreProcessError | None = None
        threading.Thread(target=self._read, args=(self._proc.stdout,), name="store-replies",
                         daemon=True).start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._ended is None

    def start(self, host: str) -> concurrent.futures.Future[Store]:
        """A store on `host`, once the process has started it."""
        future: concurrent.futures.Future[Store] = concurrent.futures.Future()
        seq = next(self._seq)
        with self._write_lock:
            if self._ended is not None:
                future.set_exception(self._ended)
                return future
            self._waiting[seq] = future
            try:
                self._send({"seq": seq, "start": host})
            except (OSError, ValueError) as exc:  # ValueError: stdin closed by `stop`
                del self._waiting[seq]
                future.set_exception(StoreProcessError(f"the store process: {exc}"))
        return future

    def close_store(self, store: Store) -> None:
        with self._write_lock, contextlib.suppress(OSError, ValueError):
            if self._ended is None:
                self._send({"close": store.id})

    def stop(self) -> None:
        """End the process (and every store in it); waits for nothing."""
        with self._write_lock, contextlib.suppress(OSError):
            self._stdin.close()
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()

    def _send(self, request: dict[str, Any]) -> None:
        self._stdin.write(json.dumps(request) + "\n")
        self._stdin.flush()

    def _read(self, replies: IO[str]) -> None:
        try:
            self._dispatch(replies)
        except (OSError, ValueError, KeyError) as exc:
            log.error("the store process's replies: %s; ending it", exc)
            self._proc.kill()
        code = self._proc.wait()
        with self._write_lock:
            self._ended = StoreProcessError(f"the store process exited (code {code})")
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(self._ended)

    def _dispatch(self, replies: IO[str]) -> None:
        """Hand each reply to its request's future, until the replies end."""
        for line in replies:
            reply = json.loads(line)
            with self._write_lock:
                future = self._waiting.pop(int(reply["seq"]), None)
            if future is None:
                continue
            store = None if "error" in reply else Store(int(reply["id"]), int(reply["port"]))
            if not future.set_running_or_notify_cancel():
                if store is not None:
                    self.close_store(store)  # nobody waits for it any more
            elif store is None:
                future.set_exception(StoreProcessError(reply["error"]))
            else:
                future.set_result(store)


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
        self._process: StoreProcess | None = None
        self._stores: dict[int, Store] = {}
        self._spare: asyncio.Future[Store] | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def process_pid(self) -> int | None:
        """The store process's pid, once started."""
        return None if self._process is None else self._process.pid

    def preload(self) -> None:
        """Start the store process (and its import of torch) ahead of the first store."""
        self._running_process()

    def prepare(self) -> None:
        """Start the spare store in the background (no-op when one is started or starting);
        a `prepare_later` pending is done with."""
        if self._timer is not None:
            self._timer.cancel()  # harmless when it is the timer's own call
            self._timer = None
        if self._spare is None:
            self._spare = self._start()

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
            store = await self._start()
        self._stores[generation] = store
        # Keep the previous generation's store a while: its workers may still be leaving.
        for old in sorted(self._stores)[:-self.keep]:
            self._close(self._stores.pop(old))
        return store.port

    def _start(self) -> asyncio.Future[Store]:
        return asyncio.wrap_future(self._running_process().start(self.host))

    def _running_process(self) -> StoreProcess:
        if self._process is not None and not self._process.alive:
            # Its stores went with it: their generations' workers fail over as from any loss.
            log.error("the store process exited; starting another")
            self._stores.clear()
            self._process = None
        if self._process is None:
            self._process = StoreProcess()
        return self._process

    def _close(self, store: Store) -> None:
        if self._process is not None:
            self._process.close_store(store)

    def close(self) -> None:
        self._stores.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._spare is not None:
            self._spare.cancel()
            self._spare = None
        if self._process is not None:
            self._process.stop()
            self._process = None


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
