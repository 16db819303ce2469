"""The agent's cache of its job's keys in etcd, kept current by ONE prefix watch per agent.

Every other part (leader, admin RPCs, the worker service) reads this view instead of asking
etcd, so an agent costs etcd one watch however many workers and admin calls it serves. After a
stream error (etcd restarted, network) the view is re-read whole at one revision and the watch
resumes from there, so no change is missed even if that revision was compacted meanwhile, and
an etcd restored from a backup (its revision went backwards) is followed rather than ignored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.control.etcd_client import ETCD_ERRORS, KV, PUT, Etcd, WatchCompacted
from daemon.control.keys import Keys
from daemon.control.records import (
    CheckpointRecord,
    ControlRequest,
    Cordon,
    Directive,
    JobSpec,
    JobStatus,
    NodeRecord,
    Progress,
    RestoreRecord,
    SnapshotHoldings,
)
from daemon.control.schema import FAMILIES, RECORDS, MalformedRecord, decode, entry
from daemon.tasks import Backoff
from parallel.planner import Plan

log = logging.getLogger(__name__)
# What the view keeps of the namespace (daemon/control/schema.py): all but rendezvous/.
_VIEWED = frozenset({*FAMILIES, "leader", "generation", "spec", "progress", "checkpoint",
                     "directive", "status", "restore"})

Listener = Callable[[set[str]], None]


class HistoryRewound(Exception):
    """etcd answered the watch at a revision below the one the view read at: it was restored
    from an older state after the read (a watch from a revision etcd has not reached yet is
    accepted and stays silent until it does), so the view must be re-read."""

    def __init__(self, revision: int, read_at: int) -> None:
        super().__init__(f"etcd's revision went backwards ({revision} < {read_at}) after the "
                         "view was read")


@dataclass(frozen=True)
class Member:
    record: NodeRecord
    lease: int
    create_revision: int


class ClusterView:
    def __init__(self, etcd: Etcd, keys: Keys, retry_s: float = 0.2) -> None:
        self.etcd = etcd
        self.keys = keys
        self.retry_s = retry_s
        self.nodes: dict[str, Member] = {}
        self.leader: tuple[str, int] | None = None  # (node, create_revision = fencing token)
        self.plan: Plan | None = None
        self.generation = 0
        self.generation_mod_revision = 0
        self.spec: KV | None = None
        self.job_spec = JobSpec()
        self.progress = Progress()
        self.checkpoint = CheckpointRecord()
        self.directive = Directive()
        self.status = JobStatus()
        self.control: dict[str, ControlRequest] = {}
        self.cordons: dict[str, Cordon] = {}
        self.snapshots: dict[str, SnapshotHoldings] = {}  # node -> what it holds in memory
        self.restore = RestoreRecord()
        self.revision = 0
        self.connected = False
        self.disconnected_at = 0.0  # monotonic time the watch last broke (0: never)
        self.synced = asyncio.Event()
        self._changed = asyncio.Condition()
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        """`listener(kinds)` runs after each applied batch; kinds ⊆ {nodes, leader, generation,
        spec, progress, checkpoint, directive, status, control, cordons, snapshots, restore,
        connection}. It must not block."""
        self._listeners.append(listener)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until `predicate()` holds on the view; False on timeout."""
        async with self._changed:
            try:
                async with asyncio.timeout(timeout):  # never loses a cancellation (wait_for can)
                    await self._changed.wait_for(predicate)
            except TimeoutError:
                return False
        return True

    async def run(self) -> None:
        backoff = Backoff(initial=self.retry_s, maximum=2.0)
        while True:
            try:
                await self._snapshot()
                backoff.reset()
                async for resp in self.etcd.watch(self.keys.prefix, prefix=True,
                                                  start_revision=self.revision + 1):
                    if resp.header.revision < self.revision:
                        raise HistoryRewound(resp.header.revision, self.revision)
                    kinds = {self._apply(ev.kv, ev.type == PUT) for ev in resp.events}
                    self.revision = max(self.revision, resp.header.revision)
                    await self._notify(kinds - {""})
            except (WatchCompacted, HistoryRewound) as exc:
                log.warning("%s; re-reading the view", exc)
            except ETCD_ERRORS as exc:
                if self.connected:
                    log.warning("etcd watch broke (%s); re-reading the view when it is back",
                                type(exc).__name__)
            if self.connected:
                self.connected = False
                self.disconnected_at = time.monotonic()
                await self._notify({"connection"})
            await backoff.sleep()

    async def _snapshot(self) -> None:
        kvs, revision = await self.etcd.get_prefix(self.keys.prefix)
        if revision < self.revision:
            log.warning("etcd's revision went backwards (%d < %d): restored from a backup? "
                        "resynchronising", revision, self.revision)
        generation = self.generation
        self.nodes.clear()
        self.control.clear()
        self.cordons.clear()
        self.snapshots.clear()
        self.restore = RestoreRecord()
        self.leader, self.spec, self.job_spec = None, None, JobSpec()
        self.progress, self.checkpoint = Progress(), CheckpointRecord()
        self.directive, self.status = Directive(), JobStatus()
        self.plan, self.generation, self.generation_mod_revision = None, 0, 0
        kinds = {self._apply(kv, True) for kv in kvs}
        if self.generation != generation:
            kinds.add("generation")
        self.revision = revision
        self.connected = True
        self.synced.set()
        await self._notify((kinds | {"nodes", "leader", "control", "connection"}) - {""})

    async def _notify(self, kinds: set[str]) -> None:
        if not kinds:
            return
        async with self._changed:
            self._changed.notify_all()
        for listener in self._listeners:
            listener(kinds)

    def _apply(self, kv: Any, put: bool) -> str:
        """Apply one key change; returns which part of the view changed ("" for none)."""
        e = entry(self.keys, kv.key)
        if e.kind not in _VIEWED:
            return ""
        record: Any = None
        if put:
            try:
                record = decode(e.kind, kv.value)
            except MalformedRecord as exc:
                log.error("ignoring the malformed value of %s: %s",
                          self.keys.relative(kv.key), exc)
                return ""
        if e.kind == "generation":
            return self._apply_generation(record, kv.mod_revision) if put else ""
        if e.kind == "nodes":
            if put:
                self.nodes[e.subject] = Member(record, kv.lease, kv.create_revision)
            else:
                self.nodes.pop(e.subject, None)
        elif e.kind in FAMILIES:
            members = getattr(self, e.kind)  # control, snapshots, cordons
            if put:
                members[e.subject] = record
            else:
                members.pop(e.subject, None)
        elif e.kind == "leader":
            self.leader = (record, kv.create_revision) if put else None
        elif e.kind == "spec":
            self.spec = KV(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease) \
                if put else None
            self.job_spec = record if put else JobSpec()
        else:  # progress, checkpoint, directive, status, restore: one record each
            setattr(self, e.kind, record if put else RECORDS[e.kind]())
        return e.kind

    def _apply_generation(self, plan: Plan, mod_revision: int) -> str:
        if plan.generation <= self.generation:
            # Within one etcd history generations only grow; a replayed value is not news.
            return ""
        self.plan, self.generation = plan, plan.generation
        self.generation_mod_revision = mod_revision
        return "generation"

    # -- queries --------------------------------------------------------------------------

    @property
    def leader_node(self) -> str:
        return self.leader[0] if self.leader else ""
