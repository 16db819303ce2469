"""The leader's pure decision function: failure, join, drain, cordon, crash loop, leader change."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from daemon.control.crash_loop import retry_delay
from daemon.control.decide import boundary_timeout, decide
from daemon.control.facts import (
    Action,
    ClusterFacts,
    ConsumeRequests,
    CordonNodes,
    Decision,
    MemberInfo,
    ProbeNodes,
    ProbeResult,
    SetDirective,
    SetStatus,
    StartGeneration,
)
from daemon.control.records import (
    CheckpointRecord,
    ControlOp,
    ControlRequest,
    Cordon,
    Directive,
    FailureKind,
    FailureRecord,
    JobState,
    JobStatus,
    NodeState,
    Progress,
)
from parallel import job as jobmod
from parallel.planner import NodeInfo, Plan, plan_generation

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TINY = (REPO / "examples" / "tiny.toml").read_text()
JOB = jobmod.loads(TINY)
FAULT = JOB.fault
NOW = 10_000.0
TTL = 5.0
REV = 7  # the spec revision of the running job
CKPT = CheckpointRecord(generation=1, step=40, path="/ckpt/step-40")

A = TypeVar("A", bound=Action)


def make_plan(nodes: Sequence[str], generation: int = 1,
              job: jobmod.JobConfig = JOB) -> Plan:
    return plan_generation(job, [NodeInfo(n, 1) for n in nodes], generation, ("h", 1))


def snap(plan_nodes: Sequence[str] | None = ("a", "b", "c"), *,
         members: Iterable[str] | Mapping[str, MemberInfo] = ("a", "b", "c"),
         generation: int = 1, step: int = 42, **changes: Any) -> ClusterFacts:
    """A healthy running generation on `plan_nodes`, modified by `changes`."""
    plan = make_plan(plan_nodes, generation) if plan_nodes is not None else None
    member_map = dict(members) if isinstance(members, Mapping) else \
        {n: MemberInfo(1) for n in members}
    base: dict[str, Any] = dict(
        now=NOW, ttl=TTL, job=JOB, spec_revision=REV, members=member_map, plan=plan,
        progress=Progress(generation=generation, step=step) if plan else Progress(),
        checkpoint=CKPT, directive=Directive(generation=generation) if plan else Directive(),
        status=JobStatus(state=JobState.RUNNING, spec_revision=REV, time=NOW - 500)
        if plan else JobStatus(spec_revision=REV))
    base.update(changes)
    return ClusterFacts(**base)


def only(decision: Decision, kind: type[A]) -> A:
    found = [a for a in decision.actions if isinstance(a, kind)]
    assert len(found) == 1, f"expected one {kind.__name__} in {decision.actions}"
    return found[0]


def none_of(decision: Decision, *kinds: type[Action]) -> None:
    found = [a for a in decision.actions if isinstance(a, kinds)]
    assert not found, f"unexpected {found}"


def kinds(decision: Decision) -> list[str]:
    return [type(a).__name__ for a in decision.actions]


def failure_req(node: str = "a", generation: int = 1, step: int = 42,
                kind: FailureKind = FailureKind.PEER, message: str = "boom") -> ControlRequest:
    return ControlRequest(op=ControlOp.FAILURE, node=node, generation=generation, kind=kind,
                          step=step, message=message, time=NOW)


def failed_status(*failures: FailureRecord, state: JobState = JobState.RUNNING) -> JobStatus:
    return JobStatus(state=state, spec_revision=REV, failures=failures, time=NOW - 500)


# -- steady state --------------------------------------------------------------------------


def test_no_job_means_nothing_to_do() -> None:
    assert decide(snap(job=None)) == Decision()


def test_healthy_running_generation_needs_no_action() -> None:
    assert decide(snap()) == Decision()


def test_first_generation_starts_from_init_then_the_status_says_running() -> None:
    d = decide(snap(None, checkpoint=CheckpointRecord()))
    assert kinds(d) == ["StartGeneration", "SetStatus"]
    start = only(d, StartGeneration)
    assert start.reason == "start" and start.plan.nodes == ("a", "b", "c")
    assert start.plan.generation == 1 and start.plan.restore.source == "init"
    assert only(d, SetStatus).status.state == JobState.RUNNING


# -- failure -------------------------------------------------------------------------------


def test_failure_report_probes_the_members_and_is_consumed_before_any_new_generation() -> None:
    d = decide(snap(control={"r1": failure_req("a", step=42)}))
    assert only(d, ProbeNodes).nodes == ("a", "b", "c")
    assert only(d, ConsumeRequests).ids == ("r1",)
    none_of(d, StartGeneration)  # the members that are left are known only after the probe
    status = only(d, SetStatus).status
    assert status.failures == (FailureRecord(1, 42, (), "", NOW),)
    assert isinstance(d.actions[-1], SetStatus)  # written last: a failed write is retried


def test_failure_reports_of_one_generation_merge() -> None:
    d = decide(snap(control={
        "r1": failure_req("a", step=44, kind=FailureKind.PEER),
        "r2": failure_req("b", step=43, kind=FailureKind.EXIT, message="segfault"),
    }))
    assert only(d, ConsumeRequests).ids == ("r1", "r2")
    (record,) = only(d, SetStatus).status.failures
    assert (record.generation, record.step, record.nodes) == (1, 43, ("b",))
    assert record.cause == "b: segfault"


def test_failure_report_about_a_replaced_generation_is_consumed_and_ignored() -> None:
    d = decide(snap(generation=3, control={"old": failure_req("a", generation=2)}))
    assert d.actions == (ConsumeRequests(("old",)),)


def test_after_the_probe_a_dead_member_is_left_out_of_the_next_generation() -> None:
    earlier = FailureRecord(1, 42, (), "", NOW - 2)
    d = decide(snap(members=("a", "c"), status=failed_status(earlier),
                    missing_since={"b": NOW - 1}, probes={"b": ProbeResult(False, NOW - 0.5)}))
    start = only(d, StartGeneration)
    assert start.plan.nodes == ("a", "c")
    assert start.reason == "leave"  # the only implicated node is gone
    assert (start.plan.restore.source, start.plan.restore.step) == ("checkpoint", 40)
    assert start.plan.restore.locations == ("/ckpt/step-40",)
    (record,) = only(d, SetStatus).status.failures
    assert record.nodes == ("b",) and record.step == 42
    assert d.wake_at is None


def test_a_crashed_worker_on_a_live_node_retries_at_once_on_every_member() -> None:
    record = FailureRecord(1, 42, ("b",), "b: exit 1", NOW)
    d = decide(snap(status=failed_status(record)))
    start = only(d, StartGeneration)
    assert start.reason == "failure" and start.plan.nodes == ("a", "b", "c")
    assert start.plan.generation == 2


def test_a_member_without_node_key_is_probed_first() -> None:
    d = decide(snap(members=("a", "c"), missing_since={"b": NOW - 1}))
    assert d.actions == (ProbeNodes(("b",)),)
    # A probe from before the key vanished says nothing about now.
    d = decide(snap(members=("a", "c"), missing_since={"b": NOW - 1},
                    probes={"b": ProbeResult(True, NOW - 2)}))
    assert d.actions == (ProbeNodes(("b",)),)


def test_a_missing_member_that_does_not_answer_fails_the_generation() -> None:
    d = decide(snap(members=("a", "c"), missing_since={"b": NOW - 1},
                    probes={"b": ProbeResult(False, NOW - 0.5)}))
    start = only(d, StartGeneration)
    assert start.plan.nodes == ("a", "c") and start.plan.generation == 2
    (record,) = only(d, SetStatus).status.failures
    assert record.generation == 1 and record.nodes == ("b",) and record.step == 42


def test_a_missing_member_that_answers_gets_two_ttls_to_reattach() -> None:
    since = NOW - 3
    s = snap(members=("a", "c"), missing_since={"b": since},
             probes={"b": ProbeResult(True, since + 1)})
    d = decide(s)
    assert d.actions == () and d.wake_at == since + 2 * TTL
    # Still without a key after the grace: lost.
    d = decide(dataclasses.replace(s, now=since + 2 * TTL + 0.1))
    assert only(d, StartGeneration).plan.nodes == ("a", "c")


# -- planned changes: join, drain, cordon, new job ------------------------------------------


def test_join_first_asks_the_generation_to_stop_at_a_boundary() -> None:
    d = decide(snap(members=("a", "b", "c", "d")))
    none_of(d, StartGeneration)
    directive = only(d, SetDirective).directive
    assert directive == Directive(generation=1, stop=True, checkpoint_seq=0, reason="join",
                                  time=NOW)
    assert d.wake_at == NOW + boundary_timeout(FAULT)


def test_join_starts_the_next_generation_once_stopped_restoring_from_the_checkpoint() -> None:
    stopped = Progress(generation=1, step=40, stopped=True)
    d = decide(snap(members=("a", "b", "c", "d"), progress=stopped,
                    directive=Directive(generation=1, stop=True, reason="join", time=NOW - 5)))
    none_of(d, SetDirective)
    start = only(d, StartGeneration)
    assert start.reason == "join" and start.plan.nodes == ("a", "b", "c", "d")
    assert start.plan.generation == 2
    assert start.plan.restore.source == "checkpoint" and start.plan.restore.step == 40


def test_join_before_the_generation_committed_a_step_starts_at_once() -> None:
    # Progress still names the previous generation (even one that stopped): nothing to save.
    d = decide(snap(members=("a", "b", "c", "d"), generation=2,
                    progress=Progress(generation=1, step=40, stopped=True)))
    none_of(d, SetDirective)
    start = only(d, StartGeneration)
    assert start.reason == "join" and start.plan.generation == 3
    assert start.plan.nodes == ("a", "b", "c", "d")


def test_a_stopped_generation_is_replaced_even_when_the_change_went_away() -> None:
    # The joiner left after the stop was asked: the workers stopped anyway and must not idle.
    d = decide(snap(progress=Progress(generation=1, step=40, stopped=True),
                    directive=Directive(generation=1, stop=True, reason="join", time=NOW - 5)))
    start = only(d, StartGeneration)
    assert start.plan.nodes == ("a", "b", "c") and start.plan.generation == 2
    assert start.plan.restore.step == 40


def test_a_stop_not_reached_by_the_boundary_timeout_is_a_failure() -> None:
    asked = NOW - boundary_timeout(FAULT) - 1
    d = decide(snap(members=("a", "b", "c", "d"),
                    directive=Directive(generation=1, stop=True, reason="join", time=asked)))
    none_of(d, SetDirective)
    start = only(d, StartGeneration)
    assert start.plan.nodes == ("a", "b", "c", "d") and start.plan.generation == 2
    (record,) = only(d, SetStatus).status.failures
    assert record.generation == 1 and record.step == 42 and record.nodes == ()


def test_drain_takes_the_same_planned_path() -> None:
    members = {"a": MemberInfo(1), "b": MemberInfo(1, NodeState.DRAINING), "c": MemberInfo(1)}
    d = decide(snap(members=members))
    none_of(d, StartGeneration)
    assert only(d, SetDirective).directive.reason == "drain"
    d = decide(snap(members=members, progress=Progress(generation=1, step=40, stopped=True),
                    directive=Directive(generation=1, stop=True, reason="drain", time=NOW)))
    start = only(d, StartGeneration)
    assert start.reason == "drain" and start.plan.nodes == ("a", "c")


def test_a_drain_that_leaves_no_layout_still_stops_at_a_boundary() -> None:
    # The only node drains (SIGTERM): no next generation fits, but the running one must still
    # stop at a step boundary with a checkpoint so the node can leave without losing a step.
    members = {"a": MemberInfo(1, NodeState.DRAINING)}
    d = decide(snap(("a",), members=members))
    none_of(d, StartGeneration)
    directive = only(d, SetDirective).directive
    assert directive.stop and directive.reason == "drain"
    assert only(d, SetStatus).status.state == JobState.PENDING
    # Once it stopped, the drained node leaving is no failure: the job waits for nodes.
    stopped = snap(("a",), members={}, progress=Progress(generation=1, step=40, stopped=True),
                   directive=directive)
    d = decide(stopped)
    none_of(d, StartGeneration, ProbeNodes)
    status = only(d, SetStatus).status
    assert status.state == JobState.PENDING and status.failures == ()


def test_no_layout_without_a_draining_node_and_no_step_committed_stops_nothing() -> None:
    members = {"a": MemberInfo(1, NodeState.DRAINING)}
    d = decide(snap(("a",), members=members, generation=2,
                    progress=Progress(generation=1, step=40, stopped=True)))
    none_of(d, SetDirective, StartGeneration)


def test_a_cordoned_member_keeps_its_place_in_the_running_generation() -> None:
    members = {"a": MemberInfo(1), "b": MemberInfo(1, NodeState.CORDONED), "c": MemberInfo(1)}
    assert decide(snap(members=members)) == Decision()


def test_a_cordoned_newcomer_is_not_joined() -> None:
    members = {n: MemberInfo(1) for n in "abc"} | {"d": MemberInfo(1, NodeState.CORDONED)}
    assert decide(snap(members=members)) == Decision()


def test_a_leader_cordon_removes_the_node_from_the_next_generation() -> None:
    cordons = {"b": Cordon("b", "failed 3 times", NOW - 10)}
    d = decide(snap(cordons=cordons))
    directive = only(d, SetDirective).directive
    assert directive.stop and directive.reason == "drain"
    d = decide(snap(cordons=cordons, progress=Progress(generation=1, step=40, stopped=True),
                    directive=directive))
    assert only(d, StartGeneration).plan.nodes == ("a", "c")


def test_a_new_job_submission_starts_a_fresh_status() -> None:
    old = JobStatus(state=JobState.FAILED, reason="crash loop", spec_revision=REV - 1,
                    failures=(FailureRecord(3, 5, ("a",), "a: x", NOW - 60),))
    d = decide(snap(None, status=old, checkpoint=CheckpointRecord()))
    assert only(d, StartGeneration).reason == "start"
    status = only(d, SetStatus).status
    assert (status.state, status.reason, status.failures, status.spec_revision) == \
        (JobState.RUNNING, "", (), REV)


def test_a_changed_job_stops_the_running_generation_first() -> None:
    new_job = jobmod.loads(TINY, ["train.steps=200"])
    d = decide(snap(job=new_job, spec_revision=REV + 1))
    none_of(d, StartGeneration)
    assert only(d, SetDirective).directive.reason == "job"
    assert only(d, SetStatus).status.spec_revision == REV + 1


# -- impossible job ------------------------------------------------------------------------


def test_a_job_no_node_set_can_host_is_pending_with_the_planners_reason() -> None:
    tp2 = jobmod.loads(TINY, ["parallel.tp=2"])
    d = decide(snap(None, job=tp2))
    none_of(d, StartGeneration)
    status = only(d, SetStatus).status
    assert status.state == JobState.PENDING and "parallel.tp" in status.reason
    # Already pending for the same reason: nothing to rewrite.
    assert decide(snap(None, job=tp2, status=status)) == Decision()


def test_pending_reason_names_the_leader_cordons() -> None:
    cordons = {n: Cordon(n, f"bad {n}", NOW) for n in "abc"}
    d = decide(snap(None, cordons=cordons))
    status = only(d, SetStatus).status
    assert status.state == JobState.PENDING
    assert "no ready node" in status.reason and "a (bad a)" in status.reason


# -- crash loop ----------------------------------------------------------------------------


def streak(count: int, *, nodes: tuple[str, ...] = (), steps: Sequence[int] | None = None,
           last_time: float = NOW - 100) -> tuple[FailureRecord, ...]:
    """`count` failures of generations 1..count, the last one at `last_time`."""
    steps = steps if steps is not None else [5] * count
    cause = f"{nodes[0]}: CUDA error" if nodes else ""
    return tuple(FailureRecord(g, steps[g - 1], nodes, cause, last_time - (count - g))
                 for g in range(1, count + 1))


def crash_snap(failures: tuple[FailureRecord, ...], **changes: Any) -> ClusterFacts:
    gen = failures[-1].generation
    return snap(generation=gen, step=failures[-1].step, status=failed_status(*failures),
                **changes)


def test_the_same_step_failing_on_every_node_fails_the_job_with_the_cause() -> None:
    n = FAULT.max_failures
    d = decide(crash_snap(streak(n, nodes=("a", "b", "c"))))
    none_of(d, StartGeneration, CordonNodes)
    status = only(d, SetStatus).status
    assert status.state == JobState.FAILED
    assert f"failed {n} times in a row at step 5" in status.reason
    assert "a: CUDA error" in status.reason


def test_the_same_step_failing_with_nobody_implicated_fails_the_job() -> None:
    d = decide(crash_snap(streak(FAULT.max_failures)))
    status = only(d, SetStatus).status
    assert status.state == JobState.FAILED and "collectives failed" in status.reason


def test_one_node_implicated_every_time_is_cordoned_and_left_out() -> None:
    n = FAULT.max_failures
    d = decide(crash_snap(streak(n, nodes=("b",))))
    (cordon,) = only(d, CordonNodes).cordons
    assert cordon.node == "b" and f"failed {n} times in a row" in cordon.reason
    assert "b: CUDA error" in cordon.reason and cordon.time == NOW
    start = only(d, StartGeneration)
    assert start.plan.nodes == ("a", "c") and start.reason == "failure"
    status = only(d, SetStatus).status
    assert status.state == JobState.RUNNING and status.failures == ()
    # The cordon is written before the generation that relies on it.
    assert kinds(d).index("CordonNodes") < kinds(d).index("StartGeneration")


def test_a_written_cordon_is_not_written_again() -> None:
    failures = streak(FAULT.max_failures, nodes=("b",))
    d = decide(crash_snap(failures, cordons={"b": Cordon("b", "earlier", NOW - 1)}))
    none_of(d, CordonNodes)
    assert only(d, StartGeneration).plan.nodes == ("a", "c")


def test_fewer_failures_than_the_limit_are_retried() -> None:
    d = decide(crash_snap(streak(FAULT.max_failures - 1, nodes=("a", "b", "c"))))
    assert only(d, StartGeneration).plan.nodes == ("a", "b", "c")
    none_of(d, CordonNodes)


def test_retry_delay_doubles_from_backoff_and_caps() -> None:
    fault = dataclasses.replace(FAULT, backoff_s=1.0, backoff_max_s=5.0)
    assert [retry_delay(fault, n) for n in range(1, 7)] == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]


@pytest.mark.parametrize("count", [2, 3])
def test_repeated_failures_wait_for_the_backoff(count: int) -> None:
    delay = FAULT.backoff_s * 2 ** (count - 2)
    last = NOW - delay / 2
    failures = streak(count, steps=list(range(10, 10 + count)), last_time=last)
    d = decide(crash_snap(failures))
    none_of(d, StartGeneration)
    assert d.wake_at == pytest.approx(last + delay)
    d = decide(crash_snap(failures, now=last + delay))
    assert only(d, StartGeneration).reason == "failure"


def test_failures_at_different_steps_keep_retrying_up_to_twice_the_limit() -> None:
    n = FAULT.max_failures
    d = decide(crash_snap(streak(2 * n - 1, steps=list(range(1, 2 * n)))))
    assert only(d, StartGeneration).plan.generation == 2 * n
    d = decide(crash_snap(streak(2 * n, steps=list(range(1, 2 * n + 1)))))
    status = only(d, SetStatus).status
    assert status.state == JobState.FAILED and "without progress" in status.reason


def test_progress_past_the_failing_step_clears_the_streak() -> None:
    failures = streak(2, steps=[5, 5])
    d = decide(snap(generation=3, step=6, status=failed_status(*failures)))
    none_of(d, StartGeneration)
    status = only(d, SetStatus).status
    assert status.failures == () and status.state == JobState.RUNNING
    # Not past it yet: the streak stands.
    assert decide(snap(generation=3, step=5, status=failed_status(*failures))) == Decision()


# -- leader change -------------------------------------------------------------------------


def test_a_fresh_leader_waits_on_the_stop_its_predecessor_asked_for() -> None:
    asked = NOW - 10
    d = decide(snap(members=("a", "b", "c", "d"),
                    directive=Directive(generation=1, stop=True, reason="join", time=asked)))
    assert d.actions == ()
    assert d.wake_at == asked + boundary_timeout(FAULT)


def test_a_fresh_leader_of_a_healthy_generation_does_nothing() -> None:
    s = snap(directive=Directive(generation=1, checkpoint_seq=4),
             progress=Progress(generation=1, step=99, time=NOW - 1))
    assert decide(s) == Decision()


def test_a_fresh_leader_continues_the_failure_count() -> None:
    failures = streak(FAULT.max_failures - 1, nodes=("a", "b", "c"))
    s = crash_snap(failures)
    d = decide(s)
    assert only(d, StartGeneration)
    # The generation the old leader started failed again at the same step: the job fails.
    third = FailureRecord(len(failures) + 1, 5, ("a", "b", "c"), "a: CUDA error", NOW)
    d = decide(crash_snap(failures + (third,), now=NOW + 100))
    assert only(d, SetStatus).status.state == JobState.FAILED


# -- admin requests, terminal states -------------------------------------------------------


def test_checkpoint_request_bumps_the_sequence_and_is_consumed() -> None:
    req = ControlRequest(op=ControlOp.CHECKPOINT, time=NOW)
    d = decide(snap(directive=Directive(generation=1, checkpoint_seq=2), control={"c1": req}))
    assert d.actions == (SetDirective(Directive(generation=1, checkpoint_seq=3)),
                         ConsumeRequests(("c1",)))


def test_checkpoint_sequence_of_an_older_generation_restarts() -> None:
    req = ControlRequest(op=ControlOp.CHECKPOINT, time=NOW)
    d = decide(snap(generation=2, directive=Directive(generation=1, checkpoint_seq=9, stop=True),
                    control={"c1": req}))
    assert only(d, SetDirective).directive == Directive(generation=2, checkpoint_seq=1)


def test_checkpoint_request_without_a_generation_is_consumed_only() -> None:
    req = ControlRequest(op=ControlOp.CHECKPOINT, time=NOW)
    d = decide(snap(None, control={"c1": req}, status=JobStatus(JobState.PENDING, "x",
                                                                 spec_revision=REV),
                    members=()))
    assert only(d, ConsumeRequests).ids == ("c1",)
    none_of(d, SetDirective, StartGeneration)


def test_node_requests_are_left_to_the_nodes() -> None:
    req = ControlRequest(op=ControlOp.DRAIN, node="b", time=NOW)
    assert decide(snap(control={"d1": req})) == Decision()


def test_finished_progress_finishes_the_job_and_nothing_else() -> None:
    done = Progress(generation=1, step=100, finished=True)
    d = decide(snap(members=("a", "b", "c", "d"), progress=done))
    assert len(d.actions) == 1
    status = only(d, SetStatus).status
    assert status.state == JobState.FINISHED and "step 100" in status.reason
    assert decide(snap(members=("a", "b", "c", "d"), progress=done, status=status)) == Decision()


def test_failed_is_terminal() -> None:
    status = JobStatus(state=JobState.FAILED, reason="crash loop", spec_revision=REV,
                       failures=streak(3, nodes=("a", "b", "c")))
    for s in (snap(status=status, members=("a", "b", "c", "d")),
              snap(status=status, members=("a", "c"), missing_since={"b": NOW - 100},
                   probes={"b": ProbeResult(False, NOW - 1)}),
              snap(None, status=status)):
        d = decide(s)
        none_of(d, StartGeneration, SetDirective, CordonNodes, ProbeNodes, SetStatus)
    # A failure report is still consumed, but starts nothing.
    d = decide(snap(status=status, control={"r": failure_req()}))
    none_of(d, StartGeneration)
    assert only(d, ConsumeRequests).ids == ("r",)
    assert all(a.status.state == JobState.FAILED for a in d.actions if isinstance(a, SetStatus))


def test_a_checkpoint_dir_a_node_cannot_see_fails_the_job_at_once_naming_it() -> None:
    message = "checkpoint.dir is not shared: b cannot see /ckpt/.shared-x written by a"
    s = snap(control={"f": failure_req("b", kind=FailureKind.STORAGE, message=message)})
    d = decide(s)
    status = only(d, SetStatus).status
    assert status.state == JobState.FAILED and status.reason == message
    none_of(d, StartGeneration, ProbeNodes)


def test_a_diverged_run_fails_the_job_at_once_naming_the_step_and_blaming_no_node() -> None:
    message = ("NonFiniteSteps: step 9 skipped (nonfinite_loss): 5 non-finite steps in a row "
               "(steps 5-9) reached train.max_skipped_steps=5; the loss has diverged")
    s = snap(control={"f": failure_req("b", kind=FailureKind.DIVERGED, message=message)})
    d = decide(s)
    status = only(d, SetStatus).status
    assert status.state == JobState.FAILED and status.reason == message
    none_of(d, StartGeneration, ProbeNodes, CordonNodes)


def test_a_full_disk_is_nobodys_fault_and_fails_the_job_with_its_cause_when_it_repeats() -> None:
    """The checkpoint filesystem is shared: a disk failure cordons no node, is retried, and
    the same step failing every time ends the job with the disk's message."""
    n = FAULT.max_failures
    status = JobStatus(state=JobState.RUNNING, spec_revision=REV, time=NOW - 500)
    for generation in range(1, n + 1):
        message = "OSError: [Errno 28] No space left on device: '/ckpt/step_00000008'"
        s = snap(generation=generation, step=8, status=status, now=NOW + generation * 100,
                 control={"d": failure_req("a", generation, 8, FailureKind.DISK, message)})
        d = decide(s)
        none_of(d, CordonNodes)
        status = only(d, SetStatus).status
        # The report is consumed (and members probed) first; the next decision retries.
        s = dataclasses.replace(s, control={}, status=status, probes={})
        d = decide(s)
        none_of(d, CordonNodes)
        if generation < n:
            assert any(isinstance(a, StartGeneration) for a in d.actions) or d.wake_at, d
        else:
            status = only(d, SetStatus).status
    assert status.state == JobState.FAILED, status
    assert f"failed {n} times in a row at step 8" in status.reason
    assert "No space left on device" in status.reason


def test_devices_too_small_for_the_running_layout_re_plan_it_at_a_boundary() -> None:
    # tiny at dp 3 is predicted at 41.4 MB per device with ZeRO-1 and 32.7 MB with ZeRO-2.
    job = jobmod.loads(TINY, ["parallel.zero=1", 'parallel.replan=["zero"]'])
    plan = make_plan(("a", "b", "c"), job=job)
    small = {n: MemberInfo(1, device_memory=36_000_000) for n in "abc"}
    d = decide(snap(job=job, plan=plan, members=small))
    none_of(d, StartGeneration)
    assert only(d, SetDirective).directive.reason == "layout"
    d = decide(snap(job=job, plan=plan, members=small,
                    progress=Progress(generation=1, step=40, stopped=True),
                    directive=Directive(generation=1, stop=True, reason="layout", time=NOW - 5)))
    start = only(d, StartGeneration)
    assert start.reason == "layout" and start.plan.nodes == ("a", "b", "c")
    assert start.plan.layout.zero == 2 and "re-planned to" in start.plan.layout_reason
    # Unknown device memory (0) bounds nothing: the running layout stays.
    d = decide(snap(job=job, plan=plan, members={n: MemberInfo(1) for n in "abc"}))
    none_of(d, StartGeneration)
    none_of(d, SetDirective)
