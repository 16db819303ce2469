"""Cluster events, derived from the history of the job's keys in etcd.

Nothing extra is stored: `ultractl events` replays etcd's revisions of the job prefix (nodes,
leader, generation, spec, control) and renders each change; `-f` keeps watching. History older
than etcd's last compaction is gone, as with `kubectl get events`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from daemon.control.etcd_client import PUT, Etcd, WatchCompacted
from daemon.control.keys import Keys
from daemon.control.records import (
    ControlOp,
    ControlRequest,
    Cordon,
    Directive,
    JobSpec,
    JobStatus,
    Progress,
    RendezvousRound,
    RestoreRecord,
)
from daemon.control.schema import MalformedRecord, decode, entry
from parallel.planner import Plan


@dataclass(frozen=True)
class ClusterEvent:
    revision: int
    kind: str
    node: str = ""
    generation: int = 0
    message: str = ""


def _state(raw: bytes) -> str:
    with contextlib.suppress(MalformedRecord):
        return decode("nodes", raw).state.value
    return "?"


def render(keys: Keys, ev: Any) -> ClusterEvent | None:
    """One etcd event as a cluster event; None for keys that are not news (routine progress)
    and for values that do not parse."""
    e, kv, put = entry(keys, ev.kv.key), ev.kv, ev.type == PUT
    before = ev.prev_kv.value if ev.prev_kv.key else None
    if e.kind == "nodes":
        return _node(kv.mod_revision, e.subject, kv.value if put else None, before)
    if e.kind == "leader":
        node = kv.value.decode() if put else (before.decode() if before is not None else "")
        if not put:
            return ClusterEvent(kv.mod_revision, "leader", node,
                                message=f"{node} no longer leads")
        return ClusterEvent(kv.mod_revision, "leader", node,
                            message=f"{node} leads (fencing token {kv.create_revision})")
    if not put or e.kind not in _RENDERED:
        return None
    try:
        record = decode(e.kind, kv.value)
    except MalformedRecord:
        return None
    previous = None
    if before is not None:
        with contextlib.suppress(MalformedRecord):
            previous = decode(e.kind, before)
    return _RENDERED[e.kind](kv.mod_revision, record, previous)


def _node(rev: int, node: str, raw: bytes | None, before: bytes | None) -> ClusterEvent | None:
    if raw is None:
        return ClusterEvent(rev, "node-left", node, message=f"{node} left (lease ended)")
    state = _state(raw)
    if before is not None:
        was = _state(before)
        if was == state:
            return None
        return ClusterEvent(rev, "node-state", node, message=f"{node}: {was} -> {state}")
    return ClusterEvent(rev, "node-joined", node, message=f"{node} joined ({state})")


def _generation(rev: int, plan: Plan, _: Plan | None) -> ClusterEvent:
    r = plan.restore
    return ClusterEvent(
        rev, "generation", generation=plan.generation,
        message=f"generation {plan.generation} ({plan.reason or '?'}): world "
                f"{plan.world_size} on {','.join(sorted(plan.nodes))}; restore "
                f"{r.source}@{r.step}" + (f" ({r.reason})" if r.reason else "")
                + (f"; layout {plan.layout_reason}" if plan.layout_reason else ""))


def _spec(rev: int, spec: JobSpec, _: JobSpec | None) -> ClusterEvent:
    job = spec.config.get("job", {}).get("name", "?")
    return ClusterEvent(rev, "job-submitted", message=f"job {job} submitted")


def _status(rev: int, st: JobStatus, before: JobStatus | None) -> ClusterEvent | None:
    before = before or JobStatus()
    if (st.state, st.reason) == (before.state, before.reason):
        return None
    return ClusterEvent(rev, "job-state", message=f"job {st.state.value}"
                        + (f": {st.reason}" if st.reason else ""))


def _cordon(rev: int, c: Cordon, _: Cordon | None) -> ClusterEvent:
    return ClusterEvent(rev, "cordon", c.node, message=f"{c.node} cordoned: {c.reason}")


def _control(rev: int, req: ControlRequest, _: ControlRequest | None) -> ClusterEvent:
    if req.op == ControlOp.FAILURE:
        return ClusterEvent(rev, "failure", req.node, req.generation,
                            f"{req.node}: {req.kind.value} failure in generation "
                            f"{req.generation} at step {req.step}: {req.message[:300]}"
                            + (f"\n{req.stacks}" if req.stacks else ""))
    return ClusterEvent(rev, "control", req.node,
                        message=f"{req.op.value} {req.node}".strip() + " requested")


def _restore(rev: int, r: RestoreRecord, _: RestoreRecord | None) -> ClusterEvent:
    what = {"snapshot": f"snapshot@{r.step} from memory ({r.snapshot_bytes} bytes on rank 0)",
            "checkpoint": f"checkpoint@{r.step}", "init": "nothing (step 0)"}.get(
                r.source, f"{r.source}@{r.step}")
    skipped = f"; the planned {r.planned} was skipped: {r.skipped[:300]}" if r.skipped else ""
    return ClusterEvent(rev, "restore", generation=r.generation,
                        message=f"generation {r.generation} restored {what} in "
                                f"{r.seconds:.2f}s{skipped}")


def _progress(rev: int, p: Progress, before: Progress | None) -> ClusterEvent | None:
    before = before or Progress()
    new_skip = p.skipped_step and (p.generation, p.skipped_step) != (before.generation,
                                                                      before.skipped_step)
    if not new_skip:
        if p.eval_step and (p.generation, p.eval_step) != (before.generation, before.eval_step):
            return ClusterEvent(rev, "eval", generation=p.generation,
                                message=f"step {p.eval_step}: eval_loss {p.eval_loss:.6g}")
        return None  # routine progress is not news
    return ClusterEvent(rev, "skipped-step", generation=p.generation,
                        message=f"step {p.skipped_step} skipped on every rank "
                                f"({p.skipped_reason}): its update was not applied, its "
                                f"samples were consumed")


def _directive(rev: int, d: Directive, _: Directive | None) -> ClusterEvent:
    return ClusterEvent(rev, "directive", generation=d.generation,
                        message=f"generation {d.generation}: "
                                + (f"stop at the next step boundary ({d.reason}), "
                                   if d.stop else "")
                                + f"checkpoint requests {d.checkpoint_seq}")


def _rendezvous(rev: int, r: RendezvousRound, before: RendezvousRound | None
                ) -> ClusterEvent | None:
    """Plain torchrun's rendezvous (daemon/rendezvous/): a round that completes, nodes that
    join or wait, the close; heartbeats rewrite the same summary and are not news."""

    def news(x: RendezvousRound) -> tuple[object, ...]:
        return (x.round, x.complete, x.closed, x.participants, x.waiting)

    if before is not None and news(before) == news(r):
        return None
    nodes = f"{len(r.participants)} node{'s' if len(r.participants) != 1 else ''}"
    same_round = before is not None and before.round == r.round and before.complete
    left = [n for n in before.participants if n not in r.participants] if same_round else []
    if r.closed:
        message = f"rendezvous closed (round {r.round})"
    elif left:
        message = f"rendezvous round {r.round}: {', '.join(left)} left ({len(r.participants)} remaining)"
    elif r.complete:
        message = f"rendezvous round {r.round} complete: {nodes} ({', '.join(r.participants)})"
    else:
        message = (f"rendezvous round {r.round}: {nodes} of {r.min_nodes}:{r.max_nodes} "
                   "joined")
    if r.waiting:
        message += f"; waiting for the next round: {', '.join(r.waiting)}"
    return ClusterEvent(rev, "rendezvous", generation=r.round, message=message)


# Each key kind whose puts are news (daemon/control/schema.py): its record, and the one before.
_RENDERED: dict[str, Callable[[int, Any, Any], ClusterEvent | None]] = {
    "generation": _generation, "spec": _spec, "status": _status, "cordons": _cordon,
    "control": _control, "restore": _restore, "progress": _progress,
    "rendezvous/round": _rendezvous, "directive": _directive,
}


# A progress notification ends a replay only once some event came, or this long after the
# watch began: etcd before 3.5.8 may answer a progress request on a watch that starts in the
# past with the current revision *before* it sends the history (etcd issue 15220), and a replay
# that trusted it returned nothing. etcd sends a lagging watch its history every 100 ms.
_SYNC_GRACE_S = 1.0


async def history(etcd: Etcd, keys: Keys, follow: bool) -> AsyncIterator[ClusterEvent]:
    """Events from the oldest kept revision; without `follow`, up to the revision at call time."""
    _, until = await etcd.get_prefix(keys.prefix)
    start = 1
    while True:
        began, synced = time.monotonic(), False
        try:
            async for resp in etcd.watch(keys.prefix, prefix=True, start_revision=start,
                                         progress_every=None if follow else 0.1):
                for ev in resp.events:
                    event = render(keys, ev)
                    if event is not None and (follow or event.revision <= until):
                        yield event
                    start = ev.kv.mod_revision + 1
                synced = synced or bool(resp.events) or \
                    time.monotonic() - began > _SYNC_GRACE_S
                caught_up = synced and not resp.events and not resp.created
                if not follow and (start > until or (caught_up and resp.header.revision >= until)):
                    return
            return
        except WatchCompacted as exc:
            start = exc.compact_revision
