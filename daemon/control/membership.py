"""Membership: this node's leased key `nodes/<node>`, kept alive, and self-fencing.

A node is a member while its lease lives. The agent holds one long-lived keepalive stream. If
no keepalive has been acknowledged for one TTL (measured from the send time, see
`KeepAlive.deadline`) the lease may be gone in etcd and another agent may already act on that.
Before that deadline the agent asks its peers whether they reach etcd (`outage_check`): if any
does, or any cannot be asked, this node is the one cut off and it fences itself (stops its
workers, drops leadership) and joins again with a new lease. If every peer is cut off too,
nobody can write a new generation, so the workers keep training while the agent holds on for up
to `outage_s`; when etcd is back it re-attaches with a new lease and no worker restarts
(docs/architecture.md, "etcd outages").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from daemon.control.etcd_client import ETCD_ERRORS, Etcd, KeepAlive
from daemon.control.keys import Keys
from daemon.control.records import NodeRecord, NodeState
from daemon.tasks import Backoff

log = logging.getLogger(__name__)
_REATTACH = "re-attach"

FenceCallback = Callable[[str], Awaitable[None]]
# Returns None when every peer is cut off from etcd too (an outage: hold on), else why to fence.
OutageCheck = Callable[[], Awaitable[str | None]]


class Membership:
    def __init__(self, etcd: Etcd, keys: Keys, record: NodeRecord, ttl: int,
                 on_fenced: FenceCallback, outage_check: OutageCheck | None = None,
                 outage_s: float = 60.0) -> None:
        self.etcd = etcd
        self.keys = keys
        self.record = record
        self.ttl = ttl
        self.on_fenced = on_fenced
        self.outage_check = outage_check
        self.outage_s = outage_s
        self.holding_since = 0.0  # monotonic start of an outage hold (0: not holding)
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
            if reason == _REATTACH:
                log.warning("re-attaching after an etcd outage with a new lease; workers keep "
                            "running")
            else:
                log.warning("fencing myself: %s", reason)
                await self.on_fenced(reason)
            # If etcd still has the old lease (we only lost contact), it must not outlive us;
            # _join revokes it before taking our key back.
            self._stale_lease = old

    async def _join(self) -> None:
        backoff = Backoff(initial=0.1, maximum=self.ttl / 2)
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
            await backoff.sleep()

    async def _hold(self) -> str:
        keepalive = self._keepalive
        assert keepalive is not None
        task = asyncio.create_task(keepalive.run(), name="keepalive")
        check: asyncio.Task[str | None] | None = None
        back_since = 0.0  # holding, and peers say etcd is back: since when
        try:
            while not self._leaving:
                now = time.monotonic()
                if keepalive.expired.is_set():
                    return _REATTACH if self.holding_since else "etcd says my lease expired"
                if now < keepalive.deadline - self.ttl / 3:
                    if self.holding_since:
                        log.warning("etcd is back after %.1fs", now - self.holding_since)
                    self.holding_since = back_since = 0.0
                    check = None
                elif check is None or check.done():
                    # Ask early and keep asking: peers whose keepalives stopped a moment after
                    # ours flip to "cut off" a moment later, and the freshest answer counts.
                    check = asyncio.create_task(self._check_outage(), name="outage-check")
                if now >= keepalive.deadline:
                    verdict = await check if check is not None else "no outage check"
                    check = None
                    if verdict is not None and not self.holding_since:
                        return f"no keepalive acknowledged for {self.ttl}s ({verdict})"
                    if verdict is not None:
                        # Holding, and a peer reaches etcd again: our own keepalive may just be
                        # reconnecting. Allow it one TTL, well inside the two TTLs the leader
                        # grants a member that answers its probe, then fence.
                        back_since = back_since or now
                        if now - back_since > self.ttl:
                            return f"etcd is back for others but not for me ({verdict})"
                        await asyncio.sleep(min(0.1, self.ttl / 20))
                        continue
                    back_since = 0.0
                    if not self.holding_since:
                        self.holding_since = now
                        log.warning("etcd is unreachable for every peer too: keeping the "
                                    "workers running for up to %.0fs", self.outage_s)
                    if now - self.holding_since > self.outage_s:
                        return f"etcd unreachable for more than {self.outage_s:.0f}s"
                await asyncio.sleep(min(0.1, self.ttl / 20))
            return "leaving"
        finally:
            for t in (task, check):
                if t is not None:
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t

    @property
    def etcd_ok(self) -> bool:
        """Our keepalives are being acknowledged (what peers ask in their outage checks)."""
        k = self._keepalive
        return self.joined.is_set() and k is not None \
            and time.monotonic() < k.deadline - self.ttl / 2

    async def _check_outage(self) -> str | None:
        if self.outage_check is None:
            return "no peers to ask"
        try:
            return await self.outage_check()
        except Exception as exc:  # noqa: BLE001 - any doubt means fence
            return f"outage check failed: {exc}"

    async def set_state(self, state: NodeState | str) -> NodeRecord:
        """Publish a new admin state (ready/draining/cordoned) under the current lease."""
        self.record = self.record.with_state(state)
        if self.lease_id:
            await self.etcd.put(self.keys.node(self.record.node), self.record.to_json(),
                                lease=self.lease_id)
        return self.record

    async def leave(self) -> None:
        """Revoke the lease: peers see this node go at once instead of after a TTL. A revoke
        etcd does not answer in time is logged, not raised: the node leaves either way, and its
        peers see it go when the lease expires (within one TTL)."""
        self._leaving = True
        if self.lease_id:
            try:
                await asyncio.wait_for(self.etcd.revoke(self.lease_id), self.etcd.timeout)
            except ETCD_ERRORS as exc:
                log.warning("leaving without revoking lease %x (%s): peers see this node go "
                            "when the lease expires, within %ds", self.lease_id,
                            str(exc) or type(exc).__name__, self.ttl)
        self.lease_id = 0
        self.joined.clear()
