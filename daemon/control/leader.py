"""What the elected agent does: carry out `decide()`'s actions with fenced writes.

Every write is a transaction guarded by the leader key's create_revision (the fencing token,
election.py); a generation is additionally guarded by the generation key's mod_revision as read,
so a number is never written twice, even by two agents that both believe they lead. The
decisions themselves are pure (decide.py); this module only gathers the snapshot they need,
performs the effects (writes, probes, the c10d store), and sleeps until something changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from daemon.control.decide import decide
from daemon.control.election import Election, FencedConflict, NotLeader
from daemon.control.etcd_client import ETCD_ERRORS, Etcd
from daemon.control.facts import (
    Action,
    ClusterFacts,
    ConsumeRequests,
    CordonNodes,
    MemberInfo,
    ProbeNodes,
    ProbeResult,
    SetDirective,
    SetStatus,
    StartGeneration,
)
from daemon.control.keys import Keys
from daemon.control.records import ControlOp, SnapshotHoldings
from daemon.control.schema import decode
from daemon.control.store_host import StoreHost
from daemon.control.view import ClusterView
from daemon.tasks import Backoff
from parallel import job as jobmod
from parallel.planner import Plan, StoreAddress

log = logging.getLogger(__name__)

Probe = Callable[[str], Awaitable[bool]]
# What the agent at an address holds of snapshots now (None: no answer, or it keeps none).
AskHoldings = Callable[[str], Awaitable[SnapshotHoldings | None]]
# A written generation's workers join its store and build within a second or so; the next
# generation's store starts after that, not while they do (daemon/control/store_host.py).
SPARE_STORE_DELAY_S = 2.0
_MAX_BATCH_WRITES = 64
_WAKE_ON = {"nodes", "spec", "control", "generation", "leader", "progress", "checkpoint",
            "cordons", "directive", "status", "connection"}


def job_from_view(view: ClusterView) -> jobmod.JobConfig | None:
    """The submitted job (validated by SubmitJob), or None when none is (or it is unreadable)."""
    if view.spec is None:
        return None
    try:
        return jobmod.from_dict(view.job_spec.config)
    except jobmod.ConfigError as exc:
        log.error("the stored job spec is invalid (%s); resubmit it", exc)
        return None


class Leader:
    def __init__(self, etcd: Etcd, keys: Keys, view: ClusterView, election: Election,
                 store: StoreHost, ttl: float, debounce_s: float, probe: Probe,
                 ask_holdings: AskHoldings | None = None) -> None:
        self.etcd = etcd
        self.keys = keys
        self.view = view
        self.election = election
        self.store = store
        self.ttl = ttl
        self.debounce_s = debounce_s
        self.probe = probe
        self.ask_holdings = ask_holdings
        self._wake = asyncio.Event()
        self._missing_since: dict[str, float] = {}
        self._probes: dict[str, ProbeResult] = {}
        # Last known address of every node: a member whose key is gone may still answer.
        self._addresses: dict[str, str] = {}
        # (the stored spec, its job): parsed once per submission, not at every decision (the
        # leader decides at every progress report, several times a second)
        self._job: tuple[bytes | None, jobmod.JobConfig | None] = (None, None)
        # (the nodes probed, the holdings of the others asked meanwhile): for the decision
        # right after a failure's probe
        self._asked: tuple[frozenset[str], asyncio.Task[dict[str, SnapshotHoldings]]] | None \
            = None
        self._written = 0  # etcd revision of this leader's last write
        view.subscribe(self._on_view)

    def _on_view(self, kinds: set[str]) -> None:
        if kinds & _WAKE_ON:
            self._wake.set()

    async def lead(self) -> None:
        """Run while this agent leads; returns when leadership is lost."""
        try:
            await self._lead()
        finally:
            if self._asked is not None:
                self._asked[1].cancel()
                self._asked = None

    async def _lead(self) -> None:
        self.store.prepare()  # the first generation this agent writes as leader finds it ready
        self._wake.set()
        self._missing_since.clear()
        self._probes.clear()
        wake_at: float | None = None
        again = False
        backoff = Backoff(initial=0.1, maximum=self.ttl / 2)
        while self.election.is_leader:
            # Every await below can complete without suspending (a set event, a met condition,
            # a gather of nothing): yield once a round, so that this loop can be cancelled and
            # never starves the agent's other tasks.
            await asyncio.sleep(0)
            timeout = self.ttl if wake_at is None else max(0.0, min(self.ttl,
                                                                    wake_at - time.time()))
            # asyncio.timeout, not wait_for: 3.11's wait_for can lose a cancellation that
            # arrives as the wait completes, and this loop would then never end.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            held = self.view.leader
            # A newer leader key than ours means we lost it; an older one is just watch lag.
            if held is not None and held[1] > self.election.token:
                self.election.drop(f"leader key now held by {held[0]}")
                return
            self._wake.clear()
            if not again and not self._stopped_as_asked():
                # Let a burst of changes settle into one decision: joins, and the failure
                # reports of one fault (every rank of a broken world reports; a decision on the
                # first alone would blame its node only). The follow-up of our own actions needs
                # no such wait, nor does a generation that stopped as asked.
                await self._settle()
            again = False
            try:
                # Decide on a view that includes our own last writes: a decision made on the
                # view from before them would make them again (a second generation, say).
                if not await self.view.wait_for(
                        lambda: self.view.revision >= self._written, timeout=self.ttl):
                    # etcd's history went backwards (a restore) or the watch is down: the
                    # view has resynchronised or will; do not wait for that revision again.
                    log.warning("the view did not reach revision %d in %ss; deciding on it "
                                "as it is", self._written, self.ttl)
                    self._written = 0
                decision = decide(self.facts())
                asked = self._take_asked()
                if self.ask_holdings is not None and any(
                        isinstance(a, StartGeneration) for a in decision.actions):
                    # Agents publish their holdings at most twice a second: the restore is
                    # planned on what every member holds now.
                    held = await asked if asked is not None else await self._holdings_now()
                    decision = decide(self.facts(held))
                elif asked is not None:
                    asked.cancel()
                probes = [a for a in decision.actions if isinstance(a, ProbeNodes)]
                if self.ask_holdings is not None and probes:
                    # A probe is how a failure's new generation starts, and its restore needs
                    # every member's holdings: ask the others while probing, for the decision
                    # right after (workers that reported a failure write no more snapshots).
                    # A node whose failure report is in answered moments ago: it is asked,
                    # not suspected (a failure report probes every node of the plan, and
                    # suspecting them all left nobody to ask before the decision).
                    reported = self._reported(self.view.plan.generation) \
                        if self.view.plan is not None else set()
                    suspects = frozenset(n for a in probes for n in a.nodes
                                         if n not in reported)
                    task = asyncio.create_task(self._holdings_now(suspects))
                    # A failure of a task that ends up unused is not worth a logged traceback.
                    task.add_done_callback(lambda t: t.cancelled() or t.exception())
                    self._asked = (suspects, task)
                wake_at = decision.wake_at
                for batch in _batches(decision.actions):
                    await self._perform(batch)
                if decision.actions:
                    again = True
                    self._wake.set()  # see the consequences
                backoff.reset()
            except NotLeader as exc:
                log.warning("lost leadership: %s", exc)
                return
            except FencedConflict:
                self._wake.set()
            except ETCD_ERRORS as exc:
                log.warning("leader step failed (%s: %s); retrying", type(exc).__name__, exc)
                await backoff.sleep()
                self._wake.set()

    async def _settle(self) -> None:
        """The debounce, cut short once the running generation's failure is fully reported.

        When a generation breaks, each of its members either reports (its workers' collectives
        failed) or is dead, within a debounce of the first report. Once every member has done
        one or the other there is no report left to wait for: the members that have not
        reported are probed at once, and the wait ends when the rest have. Any other change (a
        join, say) waits out the whole debounce, unless a failure report arrives meanwhile: a
        wake for routine news (rank 0's progress, twice a second) would otherwise hold a
        failure that follows it for up to the whole debounce.
        """
        plan = self.view.plan
        if plan is None:
            await asyncio.sleep(self.debounce_s)
            return
        if not self._reported(plan.generation) and not await self.view.wait_for(
                lambda: bool(self._reported(plan.generation)), timeout=self.debounce_s):
            return
        # From the first report, not from the wake: a report that comes at the end of a
        # routine wake's debounce still gives its peers' reports (a storage failure that broke
        # the world, say, which a peer's report alone would be retried for) the whole window.
        deadline = time.monotonic() + self.debounce_s
        dead: set[str] = set()

        def accounted() -> bool:
            reported = self._reported(plan.generation)
            return all(n in reported or n in dead or n not in self.view.nodes
                       for n in plan.nodes)

        reported = self._reported(plan.generation)
        silent = [n for n in plan.nodes
                  if n != self.election.node and n not in reported and n in self.view.nodes]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.debounce_s):
                answers = await asyncio.gather(*(self._answers(n) for n in silent))
                dead.update(n for n, alive in zip(silent, answers, strict=True) if not alive)
        await self.view.wait_for(accounted, timeout=max(0.0, deadline - time.monotonic()))

    def _reported(self, generation: int) -> set[str]:
        """Nodes with a failure report about `generation` not yet consumed."""
        return {r.node for r in self.view.control.values()
                if r.op == ControlOp.FAILURE and r.generation == generation}

    async def _answers(self, node: str) -> bool:
        member = self.view.nodes.get(node)
        return member is not None and await self.probe(member.record.address)

    def _stopped_as_asked(self) -> bool:
        view = self.view
        return (view.plan is not None and view.directive.stop
                and view.directive.generation == view.plan.generation
                and view.progress.generation == view.plan.generation and view.progress.stopped)

    def request_reconcile(self) -> None:
        self._wake.set()

    def _take_asked(self) -> asyncio.Task[dict[str, SnapshotHoldings]] | None:
        """The holdings asked during the last decision's probe, if every node it probed has
        since left the view (else a suspect that turned out alive was not asked: ask anew)."""
        if self._asked is None:
            return None
        (suspects, task), self._asked = self._asked, None
        if any(n in self.view.nodes for n in suspects):
            task.cancel()
            return None
        return task

    async def _holdings_now(self, skip: frozenset[str] = frozenset()
                            ) -> dict[str, SnapshotHoldings]:
        """Every member's snapshot holdings, asked now (but those in `skip`); the published
        record of one that does not answer."""
        assert self.ask_holdings is not None
        members = sorted((n, m) for n, m in self.view.nodes.items() if n not in skip)
        answers = await asyncio.gather(*(self.ask_holdings(m.record.address) for _, m in members))
        held = dict(self.view.snapshots)
        held.update((name, h) for (name, _), h in zip(members, answers, strict=True)
                    if h is not None)
        return held

    def _job_of(self, view: ClusterView) -> jobmod.JobConfig | None:
        raw = view.spec.value if view.spec is not None else None
        if raw is None or self._job[0] != raw:
            self._job = (raw, job_from_view(view))
        return self._job[1]

    def facts(self, holdings: dict[str, SnapshotHoldings] | None = None) -> ClusterFacts:
        view, now = self.view, time.time()
        plan = view.plan
        members = {name: MemberInfo(m.record.devices, m.record.state, m.record.device_memory)
                   for name, m in view.nodes.items()}
        self._addresses.update((name, m.record.address) for name, m in view.nodes.items())
        missing = [n for n in (plan.nodes if plan else ()) if n not in members]
        for node in list(self._missing_since):
            if node not in missing:
                del self._missing_since[node]
                self._probes.pop(node, None)
        for node in missing:
            self._missing_since.setdefault(node, now)
        return ClusterFacts(
            now=now, ttl=self.ttl, job=self._job_of(view),
            spec_revision=view.spec.mod_revision if view.spec else 0, members=members,
            cordons=dict(view.cordons), plan=plan, progress=view.progress,
            checkpoint=view.checkpoint, directive=view.directive, status=view.status,
            control=dict(view.control), missing_since=dict(self._missing_since),
            probes=dict(self._probes),
            holdings=dict(view.snapshots) if holdings is None else holdings)

    # -- effects -------------------------------------------------------------------------------

    async def _fenced(self, compare: list[Any], success: list[Any]) -> list[Any]:
        responses = await self.election.fenced_txn(compare, success)
        self._written = max([self._written, *(_revision(r) for r in responses)])
        return responses

    async def _perform(self, batch: list[Action]) -> None:
        """One action, or several plain writes in one transaction (one etcd round trip)."""
        if len(batch) > 1 or _is_write(batch[0]):
            await self._fenced([], [op for action in batch for op in self._writes(action)])
            for action in batch:
                _log_written(action)
            return
        action = batch[0]
        if isinstance(action, StartGeneration):
            await self.write_generation(action.plan, action.reason)
        elif isinstance(action, ProbeNodes):
            await self._probe_nodes(action.nodes)

    def _writes(self, action: Action) -> list[Any]:
        tx, keys = self.etcd.tx, self.keys
        if isinstance(action, SetDirective):
            return [tx.put(keys.directive, action.directive.to_json())]
        if isinstance(action, SetStatus):
            return [tx.put(keys.status, action.status.to_json())]
        if isinstance(action, CordonNodes):
            return [tx.put(keys.cordon(c.node), c.to_json()) for c in action.cordons]
        assert isinstance(action, ConsumeRequests)
        return [tx.delete(keys.control_request(i)) for i in action.ids]

    async def write_generation(self, candidate: Plan, reason: str) -> Plan:
        kv = await self.etcd.get(self.keys.generation)
        number = decode("generation", kv.value).generation if kv else 0
        mod = kv.mod_revision if kv else 0
        port = await self.store.open(number + 1)
        prefix = f"generation/{number + 1}/{uuid.uuid4().hex[:12]}"
        plan = dataclasses.replace(candidate, generation=number + 1, reason=reason,
                                   store=StoreAddress(self.store.host, port, prefix))
        await self._fenced(
            [self.etcd.tx.mod(self.keys.generation) == mod],
            [self.etcd.tx.put(self.keys.generation, plan.to_json().encode())],
        )
        # The next generation's store starts once this one's workers are under way.
        self.store.prepare_later(SPARE_STORE_DELAY_S)
        log.info("generation %d (%s): world %d on %s, restore %s@%d%s", plan.generation, reason,
                 plan.world_size, ",".join(plan.nodes), plan.restore.source, plan.restore.step,
                 f", idle {','.join(plan.idle)}" if plan.idle else "")
        return plan

    async def _probe_nodes(self, nodes: tuple[str, ...]) -> None:
        """Probe agents (a failed collective, or a missing lease); revoke the unreachable."""
        if self.election.node in nodes:
            # This agent is running this line: its own key missing is watch lag or its lease
            # going as it stops. It answers for itself (else decide() would ask again at once,
            # forever); if the key stays gone, the lease rule takes over as for a peer.
            self._probes[self.election.node] = ProbeResult(True, time.time())
        results = await asyncio.gather(*(self._probe_one(n) for n in nodes
                                          if n != self.election.node))
        dead = [n for n, alive in results if not alive]
        if dead:
            log.warning("unreachable agent(s): %s", ", ".join(dead))
            # Let the view see the revoked leases before the next decision.
            await self.view.wait_for(lambda: all(n not in self.view.nodes for n in dead),
                                     timeout=self.ttl)

    async def _probe_one(self, node: str) -> tuple[str, bool]:
        member = self.view.nodes.get(node)
        address = member.record.address if member else self._addresses.get(node, "")
        alive = bool(address) and await self.probe(address)
        now = time.time()
        if not alive:
            # Its key is about to go: missing from now, and this probe already answers for it.
            self._missing_since.setdefault(node, now)
        self._probes[node] = ProbeResult(alive, now)
        if not alive and member is not None:
            try:
                await self.etcd.revoke(member.lease)
            except ETCD_ERRORS as exc:
                log.warning("could not revoke the lease of %s: %s", node, exc)
        return node, alive


def _is_write(action: Action) -> bool:
    """A plain etcd write (no compare, nothing to wait for): batched with its neighbours."""
    return isinstance(action, SetDirective | SetStatus | CordonNodes | ConsumeRequests)


def _write_count(action: Action) -> int:
    if isinstance(action, ConsumeRequests):
        return len(action.ids)
    return len(action.cordons) if isinstance(action, CordonNodes) else 1


def _batches(actions: Sequence[Action]) -> list[list[Action]]:
    """`actions` in order, adjacent plain writes together (a failure's round consumes its
    reports and records the failure in one transaction, not two), up to `_MAX_BATCH_WRITES`
    writes in a batch (etcd refuses a transaction of more than 128 operations by default)."""
    out: list[list[Action]] = []
    for action in actions:
        if out and _is_write(action) and _is_write(out[-1][-1]) and \
                sum(map(_write_count, out[-1])) + _write_count(action) <= _MAX_BATCH_WRITES:
            out[-1].append(action)
        else:
            out.append([action])
    return out


def _log_written(action: Action) -> None:
    if isinstance(action, SetDirective):
        d = action.directive
        log.info("directive for generation %d: stop=%s checkpoint_seq=%d %s",
                 d.generation, d.stop, d.checkpoint_seq, d.reason)
    elif isinstance(action, SetStatus):
        st = action.status
        (log.error if st.state.value == "failed" else log.info)(
            "job %s%s", st.state.value, f": {st.reason}" if st.reason else "")
    elif isinstance(action, CordonNodes):
        for c in action.cordons:
            log.error("cordoned %s: %s", c.node, c.reason)


def _revision(response: Any) -> int:
    """The etcd revision a transaction's put or delete response carries (0 for others)."""
    for name in ("response_put", "response_delete_range"):
        if response.HasField(name):
            return int(getattr(response, name).header.revision)
    return 0
