"""A synchronous view of the agent's etcd client, for callers that are not asyncio code.

torchrun's rendezvous handler and c10d store (daemon/rendezvous/) call from plain threads (the
agent's main thread and torch's keep-alive timer). They get the same `Etcd` the agents use (TLS,
user/password auth with token refresh, one member at a time with failover) running on an event
loop of its own in one background thread; each call here submits a coroutine to that loop and
waits for its answer, so gRPC's channels stay on the loop that made them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from daemon.control.etcd_client import ETCD_ERRORS, KV, PUT, Etcd
from daemon.control.etcd_security import EtcdSecurity

T = TypeVar("T")


class KeyTimeout(LookupError):
    """A key waited for did not appear in time (etcd itself may have answered all along)."""


class SyncEtcd:
    """`Etcd` for synchronous callers; safe to call from several threads at once."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout: float = 5.0,
                 security: EtcdSecurity | None = None) -> None:
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="etcd-sync",
                                        daemon=True)
        self._thread.start()

        async def make() -> Etcd:
            return Etcd(endpoints, timeout=timeout, security=security)

        try:
            self.etcd = self._run(make())
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """The answer of `coro` on the loop thread; `timeout` bounds the wait (default: a few
        call deadlines, enough for one failover to the next member)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return future.result(self.timeout * 3 if timeout is None else timeout)
        except FutureTimeout:
            if future.done():
                raise  # the call's own TimeoutError (the same class since Python 3.11)
            future.cancel()
            raise TimeoutError("etcd did not answer in time") from None

    @property
    def tx(self) -> Any:
        """Builders of txn comparisons and operations (aetcd's)."""
        return self.etcd.tx

    def connect(self) -> None:
        """Reach a member now; raises when none answers or one refuses (a wrong password)."""
        self._run(self.etcd.client.connect())

    def get(self, key: bytes) -> KV | None:
        return self._run(self.etcd.get(key))

    def get_prefix(self, prefix: bytes) -> tuple[list[KV], int]:
        return self._run(self.etcd.get_prefix(prefix))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        return self._run(self.etcd.put(key, value, lease))

    def delete(self, key: bytes) -> bool:
        return self._run(self.etcd.delete(key))

    def txn(self, compare: list[Any], success: list[Any],
            failure: list[Any] | None = None) -> tuple[bool, list[Any]]:
        return self._run(self.etcd.txn(compare, success, failure))

    def wait_for(self, key: bytes, timeout: float) -> KV:
        """The key's value once it exists; KeyTimeout after `timeout` seconds.

        A watch from now is opened first and the key read once it is in place, so a put that
        lands between the read and the watch is not missed; a broken watch is reopened."""
        async def first_put() -> KV:
            while True:
                try:
                    async for resp in self.etcd.watch(key):
                        if resp.created:
                            found = await self.etcd.get(key)
                            if found is not None:
                                return found
                        for ev in resp.events:
                            if ev.type == PUT:
                                kv = ev.kv
                                return KV(kv.key, kv.value, kv.create_revision,
                                          kv.mod_revision, kv.lease)
                except ETCD_ERRORS:
                    await asyncio.sleep(0.1)  # etcd went away: watch again once it answers

        async def bounded() -> KV | None:
            try:
                return await asyncio.wait_for(first_put(), timeout)
            except asyncio.TimeoutError:
                return None

        found = self._run(bounded(), timeout + self.timeout * 3)
        if found is None:
            raise KeyTimeout(f"{key.decode(errors='replace')} did not appear within "
                             f"{timeout:g}s")
        return found

    def close(self) -> None:
        """Close the channels; the view is unusable after."""
        if not self._thread.is_alive():
            return

        try:
            self._run(self.etcd.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
