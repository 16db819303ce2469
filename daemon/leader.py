"""What the elected agent does: turn membership and admin changes into generations.

The leader debounces changes (a burst of joins becomes one generation), asks the planner for
the next plan, hosts its c10d store, and writes generation g+1 in a transaction guarded by its
fencing token AND by the generation key's mod_revision as read, so a number is never written
twice, even by two agents that both believe they lead. Planned changes (join, drain) first
order the running generation to stop, with a checkpoint, at a step boundary (`directive`);
failures move on at once. It also records committed progress, fenced the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from daemon.election import Election, FencedConflict, NotLeader
from daemon.etcd_client import ETCD_ERRORS, Etcd
from daemon.keys import Keys, dumps, loads
from daemon.store_host import StoreHost
from daemon.view import ClusterView, Member
from parallel import job as jobmod
from parallel.planner import (
    NodeInfo,
    Plan,
    PlanError,
    Restore,
    StoreAddress,
    plan_generation,
)

log = logging.getLogger(__name__)

Probe = Callable[[str], Awaitable[bool]]
# Steps between "now" and the boundary a planned change stops at: ranks run in lock-step
# within one step, and a report needs a moment to reach the leader.
BOUNDARY_MARGIN = 2


def job_from_spec(raw: bytes) -> jobmod.JobConfig:
    """The JobConfig stored in `spec` by SubmitJob (already validated there)."""
    spec = loads(raw)
    return jobmod.from_dict(spec.get("config", {}))


class Leader:
    def __init__(self, etcd: Etcd, keys: Keys, view: ClusterView, election: Election,
                 store: StoreHost, ttl: float, debounce_s: float, probe: Probe) -> None:
        self.etcd = etcd
        self.keys = keys
        self.view = view
        self.election = election
        self.store = store
        self.ttl = ttl
        self.debounce_s = debounce_s
        self.probe = probe
        self.blocked = ""  # why no plan can be made now (shown by status and logs)
        self._wake = asyncio.Event()
        self._force: str | None = None
        self._progress_at = 0.0
        view.subscribe(self._on_view)

    def _on_view(self, kinds: set[str]) -> None:
        if "progress" in kinds:
            self._progress_at = time.monotonic()
        if kinds & {"nodes", "spec", "control", "generation", "leader"}:
            self._wake.set()

    async def lead(self) -> None:
        """Run while this agent leads; returns when leadership is lost."""
        self._wake.set()
        while self.election.is_leader:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.ttl)
            held = self.view.leader
            # A newer leader key than ours means we lost it; an older one is just watch lag.
            if held is not None and held[1] > self.election.token:
                self.election.drop(f"leader key now held by {held[0]}")
                return
            self._wake.clear()
            await asyncio.sleep(self.debounce_s)
            try:
                await self._handle_control()
                await self.reconcile()
            except NotLeader as exc:
                log.warning("lost leadership: %s", exc)
                return
            except FencedConflict:
                self._wake.set()
            except ETCD_ERRORS as exc:
                log.warning("leader step failed (%s); retrying", type(exc).__name__)
                await asyncio.sleep(0.2)
                self._wake.set()

    # -- generations -------------------------------------------------------------------------

    def _planning_state(self, member: Member, current: Plan | None) -> str:
        # Cordon keeps running work (as kubectl cordon does); it only bars new generations.
        state = member.record.state
        if state == "cordoned" and current is not None and member.record.node in current.nodes:
            return "ready"
        return state

    def _restore(self) -> dict[str, Any]:
        p = self.view.progress
        step = p.get("checkpoint_step", -1)
        if isinstance(step, int) and step >= 0:
            return {"source": "checkpoint", "step": step,
                    "locations": [str(p.get("checkpoint_path", ""))]}
        return {"source": "init", "step": 0, "locations": []}

    def _reason(self, current: Plan | None, candidate: Plan) -> str:
        if current is None:
            return "start"
        if current.job != candidate.job:
            return "job"
        removed = set(current.nodes) - set(candidate.nodes)
        for node in sorted(removed):
            member = self.view.nodes.get(node)
            if member is None:
                return "leave"
        return "drain" if removed else "join"

    def _running(self, current: Plan) -> bool:
        p = self.view.progress
        return (p.get("generation") == current.generation and not p.get("finished")
                and time.monotonic() - self._progress_at < 2 * self.ttl)

    async def reconcile(self) -> Plan | None:
        """Write the next generation if the desired plan differs from the current one."""
        view = self.view
        if view.spec is None:
            return None
        job = job_from_spec(view.spec.value)
        current = view.plan
        if view.progress.get("finished") and current is not None \
                and view.progress.get("generation") == current.generation:
            return None
        nodes = [NodeInfo(name, m.record.devices, self._planning_state(m, current))
                 for name, m in view.nodes.items()]
        try:
            candidate = plan_generation(job, nodes, view.generation + 1, ("", 0),
                                        self._restore())
        except PlanError as exc:
            if str(exc) != self.blocked:
                log.warning("cannot plan a generation: %s", exc)
            self.blocked = str(exc)
            return None
        self.blocked = ""
        force, self._force = self._force, None
        if force is None and current is not None and current.job == job \
                and current.ranks == candidate.ranks:
            return None
        reason = force or self._reason(current, candidate)
        if current is not None and reason in ("join", "drain") and self._running(current):
            await self._stop_at_boundary(current, job)
            candidate = dataclasses.replace(candidate, restore=Restore.from_dict(self._restore()))
        return await self.write_generation(candidate, reason)

    async def write_generation(self, candidate: Plan, reason: str) -> Plan:
        kv = await self.etcd.get(self.keys.generation)
        number = int(loads(kv.value).get("generation", 0)) if kv else 0
        mod = kv.mod_revision if kv else 0
        port = await self.store.open(number + 1)
        plan = dataclasses.replace(candidate, generation=number + 1, reason=reason,
                                   store=StoreAddress(self.store.host, port))
        await self.election.fenced_txn(
            [self.etcd.tx.mod(self.keys.generation) == mod],
            [self.etcd.tx.put(self.keys.generation, plan.to_json().encode())],
        )
        log.info("generation %d (%s): world %d on %s, restore %s@%d%s", plan.generation, reason,
                 plan.world_size, ",".join(plan.nodes), plan.restore.source, plan.restore.step,
                 f", idle {','.join(plan.idle)}" if plan.idle else "")
        return plan

    async def _stop_at_boundary(self, current: Plan, job: jobmod.JobConfig) -> None:
        step = int(self.view.progress.get("step", 0)) + BOUNDARY_MARGIN
        checkpoint = bool(job.checkpoint.dir)
        await self.write_directive({"generation": current.generation, "stop_after_step": step,
                                    "checkpoint_at_step": step if checkpoint else -1})

        def reached() -> bool:
            p = self.view.progress
            if p.get("generation") != current.generation or p.get("step", -1) < step:
                return False
            return not checkpoint or p.get("checkpoint_step", -1) >= step

        if not await self.view.wait_for(reached, timeout=4 * self.ttl):
            log.warning("generation %d did not reach its boundary step %d in time; "
                        "moving on without it", current.generation, step)

    async def write_directive(self, directive: dict[str, Any]) -> None:
        await self.election.fenced_txn([], [self.etcd.tx.put(self.keys.directive,
                                                             dumps(directive))])

    # -- admin requests and progress -----------------------------------------------------------

    async def _handle_control(self) -> None:
        for request_id, request in list(self.view.control.items()):
            op = request.get("op")
            if op == "checkpoint":
                await self._checkpoint()
            elif op == "failure":
                await self._confirm_failure(request)
            else:
                continue  # drain/cordon/uncordon are applied by the node they name
            await self.election.fenced_txn(
                [], [self.etcd.tx.delete(self.keys.control_request(request_id))])

    async def _checkpoint(self) -> None:
        current = self.view.plan
        if current is None:
            return
        step = int(self.view.progress.get("step", 0)) + BOUNDARY_MARGIN
        await self.write_directive({"generation": current.generation, "stop_after_step": -1,
                                    "checkpoint_at_step": step})

    async def _confirm_failure(self, request: dict[str, Any]) -> None:
        """A worker saw a collective fail: find out who died now rather than after a TTL."""
        current = self.view.plan
        if current is None or request.get("generation") != current.generation:
            return  # already moved past that generation
        results = await asyncio.gather(*(
            self._probe_member(node) for node in current.nodes if node != self.election.node))
        dead = [node for node, alive in results if not alive]
        log.warning("failure in generation %d (%s: %s); unreachable: %s", current.generation,
                    request.get("node"), request.get("message", "")[:200], dead or "none")
        self._force = "failure"
        self._wake.set()

    async def _probe_member(self, node: str) -> tuple[str, bool]:
        member = self.view.nodes.get(node)
        if member is None:
            return node, False
        if await self.probe(member.record.address):
            return node, True
        try:
            await self.etcd.revoke(member.lease)
        except ETCD_ERRORS as exc:
            log.warning("could not revoke the lease of %s: %s", node, exc)
        return node, False

    async def record_progress(self, progress: dict[str, Any]) -> None:
        """Merge a progress report into `progress` (a checkpoint, once recorded, is kept)."""
        merged = dict(self.view.progress)
        if merged.get("generation") not in (None, progress.get("generation")) \
                and int(progress.get("generation", 0)) < int(merged.get("generation", 0)):
            return  # a straggler of an older generation
        for key, value in progress.items():
            if key in ("checkpoint_step", "checkpoint_path") and value in (-1, ""):
                continue
            merged[key] = value
        await self.election.fenced_txn([], [self.etcd.tx.put(self.keys.progress,
                                                             json.dumps(merged).encode())])

    def request_reconcile(self, force_reason: str | None = None) -> None:
        if force_reason:
            self._force = force_reason
        self._wake.set()
