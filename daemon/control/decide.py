"""The leader's decisions: a pure function of `ClusterFacts` (the cluster view, the job, the
time, as of one moment).

`decide(facts)` returns the actions the leader should take and when to look again; the
leader (leader.py) performs them with fenced writes. Nothing here touches etcd, the network or
a clock, so every rule below is unit-tested in milliseconds (tests/unit/test_decide.py).

The rules (docs/architecture.md, "Failure handling"):
- Admin requests addressed to the leader are consumed: `checkpoint` bumps the running
  generation's checkpoint sequence; `failure` (a worker's report) is merged into the failure
  record of its generation and makes the leader probe the generation's members.
- A member of the running generation whose node key is gone is probed first: an agent that
  still answers is only re-attaching after an etcd outage and gets a grace; one that does not
  is lost, and the generation has failed.
- A failed generation is replaced at once by one on the members that are left. A cause that
  repeats `fault.max_failures` times in a row without progress stops the loop: the nodes every
  one of those failures implicates are cordoned (when that leaves anyone), else a failure at the
  same step every time fails the job. Retries after the first back off exponentially.
- A planned change (join, drain, cordon, a new job, a new layout) first asks the running generation to stop
  at a step boundary the workers agree on, with a checkpoint, and only then writes the next
  (at once when the running generation has not committed a step yet).
- When no layout fits the ready nodes, the job is `pending` with the planner's reason; if that
  is because members of the running generation drain, it still stops at a boundary first.
- A `cancel` request about the current submission: the running generation stops at a boundary
  with a checkpoint and the job is `cancelled`, not re-planned (cancel.py), until a new one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from daemon.control.cancel import cancel_step
from daemon.control.crash_loop import crash_loop_verdict, retry_delay
from daemon.control.facts import (
    Action,
    ClusterFacts,
    ConsumeRequests,
    CordonNodes,
    Decision,
    MemberInfo,
    ProbeNodes,
    SetDirective,
    SetStatus,
    StartGeneration,
)
from daemon.control.records import (
    ENDED,
    IMPLICATING,
    ControlOp,
    ControlRequest,
    Cordon,
    Directive,
    FailureKind,
    FailureRecord,
    JobState,
    JobStatus,
    NodeState,
)
from daemon.control.snapshot_steps import newest_assemblable, step_horizon
from parallel.job import FaultConfig, JobConfig
from parallel.planner import NodeInfo, Plan, PlanError, plan_generation

_MAX_CAUSE = 500  # characters of a cause kept in the status


def boundary_timeout(fault: FaultConfig) -> float:
    """How long a planned stop may take: the generation may still be joining or restoring."""
    return fault.join_timeout_s + fault.restore_timeout_s + fault.first_step_timeout_s


def decide(s: ClusterFacts) -> Decision:
    if s.job is None:
        return Decision()
    return _Decider(s).run()


class _Decider:
    """One decision; a class only to share the facts between small steps."""

    def __init__(self, s: ClusterFacts) -> None:
        assert s.job is not None
        self.s = s
        self.job: JobConfig = s.job
        self.fault = s.job.fault
        self.plan = s.plan
        self.actions: list[Action] = []
        fresh = s.status.spec_revision != s.spec_revision
        # A new submission starts with a clean slate.
        self.status = JobStatus(spec_revision=s.spec_revision) if fresh else s.status
        self.initial_status = s.status
        gen = self.plan.generation if self.plan else 0
        self.directive = s.directive if s.directive.generation == gen and gen else \
            Directive(generation=gen)
        self.initial_directive = self.directive
        self.wake_at: float | None = None

    # -- plumbing ----------------------------------------------------------------------------

    def _wake(self, at: float) -> None:
        self.wake_at = at if self.wake_at is None else min(self.wake_at, at)

    def _set(self, state: JobState, reason: str = "", **changes: object) -> None:
        self.status = dataclasses.replace(self.status, state=state, reason=reason[:_MAX_CAUSE],
                                          time=self.s.now, **changes)  # type: ignore[arg-type]

    def _finish(self) -> Decision:
        head: list[Action] = []
        if self.directive != self.initial_directive and self.plan is not None:
            head.append(SetDirective(self.directive))
        tail: list[Action] = []
        if _status_key(self.status) != _status_key(self.initial_status):
            tail.append(SetStatus(self.status))
        # The status goes last: if a write before it fails, the next decision still sees the
        # failure records that caused it.
        return Decision(tuple(head + self.actions + tail), self.wake_at)

    # -- the rules ---------------------------------------------------------------------------

    def run(self) -> Decision:
        probing = self._consume_requests()
        if self.status.state in (JobState.FAILED, JobState.CANCELLED):
            return self._finish()
        p, plan = self.s.progress, self.plan
        if plan is not None and p.finished and p.generation == plan.generation:
            if self.status.state != JobState.FINISHED:
                self._set(JobState.FINISHED, f"finished at step {p.step}")
            return self._finish()
        if self.status.cancelling:
            self._cancel()
            return self._finish()
        if probing:  # replace the generation once the probe has revoked the dead's leases
            return self._finish()
        if plan is not None and not self._members_present(plan):
            return self._finish()
        self._clear_streak_after_progress()
        failed = plan is not None and bool(self.status.failures) \
            and self.status.failures[-1].generation == plan.generation
        if failed:
            return self._after_failure()
        candidate = self._candidate()
        if candidate is None:
            self._stop_for_drain()
            return self._finish()
        if plan is None:
            self._start(candidate, "start")
        elif plan.job != self.job or plan.ranks != candidate.ranks or (
                plan.layout != candidate.layout) or (
                p.generation == plan.generation and p.stopped):
            # A generation that stopped is replaced even if the change that stopped it is gone.
            self._planned_change(candidate)
        elif self.status.state != JobState.RUNNING or self.status.reason:
            self._set(JobState.RUNNING)
        return self._finish()

    def _consume_requests(self) -> bool:  # True: probing the running generation's members
        consumed: list[str] = []
        probe = False
        for request_id, req in sorted(self.s.control.items()):
            if req.op == ControlOp.CHECKPOINT:
                if self.plan is not None:
                    self.directive = dataclasses.replace(
                        self.directive, checkpoint_seq=self.directive.checkpoint_seq + 1)
            elif req.op == ControlOp.FAILURE and req.kind in (FailureKind.STORAGE,
                                                               FailureKind.DIVERGED):
                # It names the node and the path, or the step that diverged.
                self._set(JobState.FAILED, req.message)
            elif req.op == ControlOp.FAILURE:
                probe |= self._record_failure(req)
            elif req.op == ControlOp.CANCEL:
                # A cancel of an earlier submission, or of a job that already ended, is void.
                if req.spec_revision == self.s.spec_revision and \
                        self.status.state not in ENDED and not self.status.cancelling:
                    self.status = dataclasses.replace(self.status, cancelling=True)
            else:
                continue  # drain/cordon/uncordon are applied by the node they name
            consumed.append(request_id)
        if probe and self.plan is not None:
            self.actions.append(ProbeNodes(self.plan.nodes))
        if consumed:
            self.actions.append(ConsumeRequests(tuple(consumed)))
        return probe and self.plan is not None

    def _record_failure(self, req: ControlRequest) -> bool:
        """Merge a report into its generation's record; True when it is about the running one."""
        current = self.plan.generation if self.plan else 0
        failures = list(self.status.failures)
        index = next((i for i, f in enumerate(failures) if f.generation == req.generation), None)
        if index is None and req.generation != current:
            return False  # about a generation already replaced: nothing to learn
        implicated = (req.node,) if req.kind in IMPLICATING and req.node else ()
        # A peer report only echoes someone else's failure; every other kind is a cause.
        cause = f"{req.node}: {req.message}" if req.kind != FailureKind.PEER else ""
        if index is None:
            failures.append(FailureRecord(req.generation, req.step, implicated, cause,
                                          self.s.now))
        else:
            old = failures[index]
            steps = [x for x in (old.step, req.step) if x >= 0]
            failures[index] = dataclasses.replace(
                old, step=min(steps) if steps else -1,
                nodes=tuple(sorted(set(old.nodes) | set(implicated))),
                cause=old.cause or cause)
        self.status = dataclasses.replace(self.status, failures=tuple(failures))
        return req.generation == current

    def _members_present(self, plan: Plan) -> bool:
        """False while a missing member's fate is unknown (the caller waits)."""
        s = self.s
        if s.progress.generation == plan.generation and s.progress.stopped:
            return True  # stopped at a boundary, checkpointed: a member leaving loses nothing
        lost: list[str] = []
        unprobed: list[str] = []
        reattaching = False
        for node in plan.nodes:
            if node in s.members:
                continue
            since = s.missing_since.get(node, s.now)
            probe = s.probes.get(node)
            if probe is None or probe.at < since:
                unprobed.append(node)
            elif probe.alive and s.now - since < 2 * s.ttl:
                # It answers but has no lease: re-attaching after an etcd outage.
                self._wake(since + 2 * s.ttl)
                reattaching = True
            else:
                lost.append(node)
        if unprobed:
            self.actions.append(ProbeNodes(tuple(unprobed)))
            return False
        for node in lost:
            self._record_failure(ControlRequest(
                op=ControlOp.FAILURE, node=node, generation=plan.generation,
                kind=FailureKind.LOST, step=self.s.progress.step
                if self.s.progress.generation == plan.generation else -1,
                message="agent lost (lease ended and it does not answer)"))
        return bool(lost) or not reattaching

    def _clear_streak_after_progress(self) -> None:
        failures, p = self.status.failures, self.s.progress
        if not failures or self.plan is None or p.generation != self.plan.generation:
            return
        if failures[-1].generation < self.plan.generation and \
                p.step > max(f.step for f in failures):
            self.status = dataclasses.replace(self.status, failures=())

    def _candidate(self, exclude: frozenset[str] = frozenset()) -> Plan | None:
        s, plan = self.s, self.plan
        nodes = []
        for name, m in s.members.items():
            state = m.state
            # Cordon keeps running work (as kubectl cordon does); it only bars new places.
            if state == NodeState.CORDONED and plan is not None and name in plan.nodes:
                state = NodeState.READY
            if name in s.cordons or name in exclude:
                state = NodeState.CORDONED
            nodes.append(NodeInfo(name, m.devices, state.value))
        # The smallest device any member reported bounds the layout (0: nobody knows).
        known = [m.device_memory for m in s.members.values() if m.device_memory > 0]
        try:
            return plan_generation(self.job, nodes, (plan.generation if plan else 0) + 1,
                                   ("", 0), self._restore(),
                                   current=plan.layout if plan is not None else None,
                                   memory_per_device=min(known, default=0))
        except PlanError as exc:
            reason = str(exc)
            if s.cordons:
                reason += "; cordoned: " + "; ".join(
                    f"{c.node} ({c.reason})" for c in sorted(s.cordons.values(),
                                                             key=lambda c: c.node))
            self._set(JobState.PENDING, reason)
            return None

    def _restore(self) -> dict[str, object]:
        """The fastest tier that has the newest state: a snapshot the members can assemble
        from their memory when it is at least as new as the durable checkpoint (the workers
        fall back to the checkpoint if it does not verify), else the checkpoint."""
        c = self.s.checkpoint
        durable = c.step if c.step >= 0 and c.path else -1
        held = {n: h for n, h in self.s.holdings.items()
                if n in self.s.members and h.spec_revision == self.s.spec_revision}
        # Never a step beyond what the job has been seen to reach (snapshot_steps.py): the
        # progress rank 0 reported, the durable checkpoint, the running generation's restore,
        # the steps the members' own workers wrote and replicated.
        seen = max(self.s.progress.step, durable, self.plan.restore.step if self.plan else 0,
                   *(h.replicated_through for h in held.values()))
        step, holders = newest_assemblable(
            held, step_horizon(seen, self.job.checkpoint.snapshot_every))
        if step > 0 and step >= durable:
            return {"source": "snapshot", "step": step, "locations": list(holders),
                    "checkpoint_step": max(durable, 0)}
        why = {}
        if self.s.progress.step > max(durable, 0) and self.plan is not None:
            # A restore that loses steps: say why memory could not serve it.
            why = {"reason": "no snapshot the live nodes hold whole is newer"
                   + (f" (newest: step {step})" if step > 0 else "")}
        if durable >= 0:
            return {"source": "checkpoint", "step": c.step, "locations": [c.path], **why}
        return {"source": "init", "step": 0, "locations": [], **why}

    def _start(self, candidate: Plan, reason: str) -> None:
        self.actions.append(StartGeneration(candidate, reason))
        self._set(JobState.RUNNING)

    def _after_failure(self) -> Decision:
        assert self.plan is not None
        failures = self.status.failures
        verdict = crash_loop_verdict(failures, self.fault.max_failures, set(self.plan.nodes))
        exclude: frozenset[str] = frozenset()
        if isinstance(verdict, str):
            self._set(JobState.FAILED, verdict)
            return self._finish()
        if verdict is not None:
            nodes, reason = verdict
            new = tuple(Cordon(n, reason, self.s.now) for n in nodes if n not in self.s.cordons)
            if new:
                self.actions.append(CordonNodes(new))
            exclude = frozenset(nodes)
        delay = retry_delay(self.fault, len(failures))
        if self.s.now < failures[-1].time + delay:
            self._wake(failures[-1].time + delay)
            return self._finish()
        candidate = self._candidate(exclude)
        if candidate is None:
            return self._finish()
        self._start(candidate, "leave" if _lost_only(failures[-1], self.s.members) else
                    "failure")
        if exclude:
            # A new world without the culprit: its count starts again.
            self.status = dataclasses.replace(self.status, failures=())
        return self._finish()

    def _cancel(self) -> None:
        step = cancel_step(self.plan, self.s.progress, self.directive, self.s.checkpoint,
                           self.status.failures, boundary_timeout(self.fault), self.s.now)
        if self.plan is not None:
            self.directive = step.directive
        self._set(JobState.CANCELLED if step.cancelled else self.status.state, step.reason)
        if step.wake_at is not None:
            self._wake(step.wake_at)

    def _stop_for_drain(self) -> None:
        """No layout fits without the draining nodes: still stop the running generation at a
        boundary, with a checkpoint, so they can leave without losing a step (the job then
        waits, pending, for nodes)."""
        plan, p, d = self.plan, self.s.progress, self.directive
        if plan is None or d.stop or p.generation != plan.generation or p.stopped:
            return
        members = self.s.members
        if any(n in members and members[n].state == NodeState.DRAINING for n in plan.nodes):
            self.directive = dataclasses.replace(d, stop=True, reason="drain", time=self.s.now)

    def _planned_change(self, candidate: Plan) -> None:
        plan, d, s = self.plan, self.directive, self.s
        assert plan is not None
        reason = _planned_reason(plan, candidate, self.job)
        p = s.progress
        if p.generation != plan.generation:
            # No step of this generation is committed yet (rank 0's first report is written at
            # once): nothing to save, and its workers may never get to a step boundary.
            self._start(candidate, reason)
            return
        if p.stopped:
            # The stop's checkpoint was recorded before `stopped` (one writer, in order), so
            # the candidate already restores from it.
            self._start(candidate, reason)
            return
        if not d.stop:
            self.directive = dataclasses.replace(d, stop=True, reason=reason, time=s.now)
            self._wake(s.now + boundary_timeout(self.fault))
            return
        deadline = d.time + boundary_timeout(self.fault)
        if s.now < deadline:
            self._wake(deadline)
            return
        # The generation never reached a boundary: treat it as failed rather than wait on.
        self._record_failure(ControlRequest(
            op=ControlOp.FAILURE, generation=plan.generation, kind=FailureKind.PEER,
            step=p.step if p.generation == plan.generation else -1,
            message=f"did not stop at a step boundary within {boundary_timeout(self.fault):.0f}s"))
        self._start(candidate, reason)


def _status_key(status: JobStatus) -> tuple[object, ...]:
    return (status.state, status.reason, status.failures, status.spec_revision,
            status.cancelling)


def _lost_only(failure: FailureRecord, members: Mapping[str, MemberInfo]) -> bool:
    return bool(failure.nodes) and all(n not in members for n in failure.nodes)


def _planned_reason(current: Plan, candidate: Plan, job: JobConfig) -> str:
    if current.job != job:
        return "job"
    if set(current.nodes) - set(candidate.nodes):
        return "drain"
    if set(candidate.nodes) - set(current.nodes):
        return "join"
    return "layout"
