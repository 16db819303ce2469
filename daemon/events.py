"""Cluster events, derived from the history of the job's keys in etcd.

Nothing extra is stored: `ultractl events` replays etcd's revisions of the job prefix (nodes,
leader, generation, spec, control) and renders each change; `-f` keeps watching. History older
than etcd's last compaction is gone, as with `kubectl get events`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from daemon.etcd_client import PUT, Etcd, WatchCompacted
from daemon.keys import Keys, NodeRecord, loads


@dataclass(frozen=True)
class ClusterEvent:
    revision: int
    kind: str
    node: str = ""
    generation: int = 0
    message: str = ""


def _state(raw: bytes) -> str:
    with contextlib.suppress(ValueError, TypeError):
        return NodeRecord.from_json(raw).state
    return "?"


def render(keys: Keys, ev: Any) -> ClusterEvent | None:
    """One etcd event as a cluster event; None for keys that are not news (progress)."""
    name, kv, put = keys.relative(ev.kv.key), ev.kv, ev.type == PUT
    rev = kv.mod_revision
    if name.startswith("nodes/"):
        node = name[len("nodes/"):]
        if not put:
            return ClusterEvent(rev, "node-left", node, message=f"{node} left (lease ended)")
        state = _state(kv.value)
        if ev.prev_kv.key:
            before = _state(ev.prev_kv.value)
            if before == state:
                return None
            return ClusterEvent(rev, "node-state", node, message=f"{node}: {before} -> {state}")
        return ClusterEvent(rev, "node-joined", node, message=f"{node} joined ({state})")
    if name == "leader":
        node = kv.value.decode() if put else (ev.prev_kv.value.decode() if ev.prev_kv.key else "")
        if not put:
            return ClusterEvent(rev, "leader", node, message=f"{node} no longer leads")
        return ClusterEvent(rev, "leader", node,
                            message=f"{node} leads (fencing token {kv.create_revision})")
    if name == "generation" and put:
        g = loads(kv.value)
        nodes = sorted({r.get("node", "") for r in g.get("ranks", [])})
        restore = g.get("restore", {})
        return ClusterEvent(
            rev, "generation", generation=int(g.get("generation", 0)),
            message=f"generation {g.get('generation')} ({g.get('reason', '?')}): world "
                    f"{len(g.get('ranks', []))} on {','.join(nodes)}; restore "
                    f"{restore.get('source', '?')}@{restore.get('step', 0)}")
    if name == "spec" and put:
        job = loads(kv.value).get("config", {}).get("job", {}).get("name", "?")
        return ClusterEvent(rev, "job-submitted", message=f"job {job} submitted")
    if name.startswith("control/") and put:
        req = loads(kv.value)
        node = str(req.get("node", ""))
        return ClusterEvent(rev, "control", node,
                            message=f"{req.get('op', '?')} {node}".strip() + " requested")
    if name == "directive" and put:
        d = loads(kv.value)
        return ClusterEvent(rev, "directive", generation=int(d.get("generation", 0)),
                            message=f"generation {d.get('generation')}: stop after step "
                                    f"{d.get('stop_after_step')}, checkpoint at step "
                                    f"{d.get('checkpoint_at_step')}")
    return None


async def history(etcd: Etcd, keys: Keys, follow: bool) -> AsyncIterator[ClusterEvent]:
    """Events from the oldest kept revision; without `follow`, up to the revision at call time."""
    _, until = await etcd.get_prefix(keys.prefix)
    start = 1
    while True:
        try:
            async for resp in etcd.watch(keys.prefix, prefix=True, start_revision=start,
                                         progress_every=None if follow else 0.1):
                for ev in resp.events:
                    event = render(keys, ev)
                    if event is not None and (follow or event.revision <= until):
                        yield event
                    start = ev.kv.mod_revision + 1
                caught_up = not resp.events and not resp.created
                if not follow and (start > until or (caught_up and resp.header.revision >= until)):
                    return
            return
        except WatchCompacted as exc:
            start = exc.compact_revision
