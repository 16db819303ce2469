"""Membership: this node's leased key `nodes/<node>`, kept alive, and self-fencing.

A node is a member while its lease lives. The agent holds one long-lived keepalive stream. If
no keepalive has been acknowledged for one TTL (measured from the send time, see
`KeepAlive.deadline`) the lease may be gone in etcd and another agent may already act on that:
the agent fences itself (stops its workers, drops leadership) and joins again with a new lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from daemon.etcd_client import ETCD_ERRORS, Etcd, KeepAlive
from daemon.keys import Keys, NodeRecord

log = logging.getLogger(__name__)

FenceCallback = Callable[[str], Awaitable[None]]


class Membership:
    def __init__(self, etcd: Etcd, keys: Keys, record: NodeRecord, ttl: int,
                 on_fenced: FenceCallback) -> None:
        self.etcd = etcd
        self.keys = keys
        self.record = record
        self.ttl = ttl
        self.on_fenced = on_fenced
        self.lease_id = 0
        self.joined = asyncio.Event()
        self._keepalive: KeepAlive | None = None
        self._leaving = False
        self._stale_lease = 0  # our lease before fencing, if etcd may still hold it

    async def run(self) -> None:
        while not self._leaving:
            await self._join()
            reason = await self._hold()
            if self._leaving:
                return
            old, self.lease_id = self.lease_id, 0
            self.joined.clear()
            log.warning("fencing myself: %s", reason)
            await self.on_fenced(reason)
            # If etcd still has the old lease (we only lost contact), it must not outlive us;
            # _join revokes it before taking our key back.
            self._stale_lease = old

    async def _join(self) -> None:
        delay = 0.1
        while True:
            try:
                key = self.keys.node(self.record.node)
                if self._stale_lease:
                    held = await self.etcd.get(key)
                    if held is not None and held.lease == self._stale_lease:
                        await self.etcd.revoke(self._stale_lease)
                    self._stale_lease = 0
                lease = await self.etcd.grant(self.ttl)
                # A live key of another lease is another agent with our node id, or our own
                # previous incarnation: wait for it to go rather than take its place.
                ok, _ = await self.etcd.txn(
                    [self.etcd.tx.version(key) == 0],
                    [self.etcd.tx.put(key, self.record.to_json(), lease=lease)],
                )
                if ok:
                    self.lease_id = lease
                    self._keepalive = KeepAlive(self.etcd, lease, self.ttl)
                    self.joined.set()
                    log.info("joined with lease %x (ttl %ds)", lease, self.ttl)
                    return
                log.warning("node id %s is held by another live lease; waiting",
                            self.record.node)
                await self.etcd.revoke(lease)
            except ETCD_ERRORS as exc:
                log.debug("join failed: %s", exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.ttl / 2)

    async def _hold(self) -> str:
        keepalive = self._keepalive
        assert keepalive is not None
        task = asyncio.create_task(keepalive.run(), name="keepalive")
        try:
            while not self._leaving:
                if keepalive.expired.is_set():
                    return "etcd says my lease expired"
                if time.monotonic() >= keepalive.deadline:
                    return f"no keepalive acknowledged for {self.ttl}s"
                await asyncio.sleep(min(0.1, self.ttl / 20))
            return "leaving"
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def set_state(self, state: str) -> NodeRecord:
        """Publish a new admin state (ready/draining/cordoned) under the current lease."""
        self.record = self.record.with_state(state)
        if self.lease_id:
            await self.etcd.put(self.keys.node(self.record.node), self.record.to_json(),
                                lease=self.lease_id)
        return self.record

    async def leave(self) -> None:
        """Revoke the lease: peers see this node go at once instead of after a TTL."""
        self._leaving = True
        if self.lease_id:
            with contextlib.suppress(*ETCD_ERRORS):
                await asyncio.wait_for(self.etcd.revoke(self.lease_id), self.etcd.timeout)
        self.lease_id = 0
        self.joined.clear()
