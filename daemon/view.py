"""The agent's cache of its job's keys in etcd, kept current by ONE prefix watch per agent.

Every other part (leader, admin RPCs, the worker service) reads this view instead of asking
etcd, so an agent costs etcd one watch however many workers and admin calls it serves
(notes/etcd-control-plane.md). After a stream error (etcd restarted, network) the watch is
re-created from the last revision seen, so no change is missed; if that revision was compacted,
the view is re-read whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.etcd_client import ETCD_ERRORS, KV, PUT, Etcd, WatchCompacted
from daemon.keys import Keys, NodeRecord, loads
from parallel.planner import Plan, PlanError

log = logging.getLogger(__name__)

Listener = Callable[[set[str]], None]


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
        self.progress: dict[str, Any] = {}
        self.directive: dict[str, Any] = {}
        self.control: dict[str, dict[str, Any]] = {}
        self.revision = 0
        self.connected = False
        self.synced = asyncio.Event()
        self._changed = asyncio.Condition()
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        """`listener(kinds)` runs after each applied batch; kinds ⊆ {nodes, leader, generation,
        spec, progress, directive, control}. It must not block."""
        self._listeners.append(listener)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until `predicate()` holds on the view; False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
            except asyncio.TimeoutError:
                return False
        return True

    async def run(self) -> None:
        resync = True
        while True:
            try:
                if resync:
                    await self._snapshot()
                    resync = False
                async for resp in self.etcd.watch(self.keys.prefix, prefix=True,
                                                  start_revision=self.revision + 1):
                    self.connected = True
                    kinds = {self._apply(ev.kv, ev.type == PUT) for ev in resp.events}
                    self.revision = max(self.revision, resp.header.revision)
                    await self._notify(kinds - {""})
            except WatchCompacted as exc:
                log.warning("%s; re-reading the view", exc)
                resync = True
            except ETCD_ERRORS as exc:
                if self.connected:
                    log.warning("etcd watch broke (%s); re-watching from revision %d",
                                type(exc).__name__, self.revision + 1)
                self.connected = False
            await asyncio.sleep(self.retry_s)

    async def _snapshot(self) -> None:
        kvs, revision = await self.etcd.get_prefix(self.keys.prefix)
        self.nodes.clear()
        self.control.clear()
        self.leader, self.spec, self.progress, self.directive = None, None, {}, {}
        kinds = {self._apply(kv, True) for kv in kvs}
        self.revision = revision
        self.connected = True
        self.synced.set()
        await self._notify((kinds | {"nodes", "leader", "control"}) - {""})

    async def _notify(self, kinds: set[str]) -> None:
        if not kinds:
            return
        async with self._changed:
            self._changed.notify_all()
        for listener in self._listeners:
            listener(kinds)

    def _apply(self, kv: Any, put: bool) -> str:
        """Apply one key change; returns which part of the view changed ("" for none)."""
        name = self.keys.relative(kv.key)
        if name.startswith("nodes/"):
            node = name[len("nodes/"):]
            if not put:
                self.nodes.pop(node, None)
                return "nodes"
            try:
                record = NodeRecord.from_json(kv.value)
            except (ValueError, TypeError):
                log.error("ignoring malformed node record %s", name)
                return ""
            self.nodes[node] = Member(record, kv.lease, kv.create_revision)
            return "nodes"
        if name.startswith("control/"):
            request_id = name[len("control/"):]
            if put:
                self.control[request_id] = loads(kv.value)
            else:
                self.control.pop(request_id, None)
            return "control"
        if name == "leader":
            self.leader = (kv.value.decode(), kv.create_revision) if put else None
            return "leader"
        if name == "generation":
            return self._apply_generation(kv) if put else ""
        if name == "spec":
            self.spec = KV(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease) \
                if put else None
            return "spec"
        if name in ("progress", "directive"):
            setattr(self, name, loads(kv.value) if put else {})
            return name
        return ""

    def _apply_generation(self, kv: Any) -> str:
        number = loads(kv.value).get("generation")
        if not isinstance(number, int) or number <= self.generation:
            # Generations only grow; a replayed or stale value is not news.
            return ""
        try:
            self.plan = Plan.from_json(kv.value)
        except (PlanError, ValueError) as exc:
            log.error("ignoring malformed generation %s: %s", number, exc)
            return ""
        self.generation = number
        self.generation_mod_revision = kv.mod_revision
        return "generation"

    # -- queries --------------------------------------------------------------------------

    @property
    def leader_node(self) -> str:
        return self.leader[0] if self.leader else ""
