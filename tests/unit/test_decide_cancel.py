"""decide() with `ultractl job cancel`: stop at a boundary with a checkpoint, then `cancelled`."""

from __future__ import annotations

import dataclasses

import pytest

from daemon.control.decide import boundary_timeout, decide
from daemon.control.facts import ClusterFacts, ConsumeRequests, SetDirective, SetStatus
from daemon.control.records import (
    CheckpointRecord,
    ControlOp,
    ControlRequest,
    Directive,
    JobState,
    JobStatus,
    Progress,
)
from tests.unit.test_decide import CKPT, FAULT, NOW, REV, failure_req, kinds, none_of, only, snap

pytestmark = pytest.mark.unit


def cancel_req(revision: int = REV) -> ControlRequest:
    return ControlRequest(op=ControlOp.CANCEL, spec_revision=revision, time=NOW)


def cancelling(status: JobStatus | None = None) -> JobStatus:
    base = status or JobStatus(state=JobState.RUNNING, spec_revision=REV, time=NOW - 500)
    return dataclasses.replace(base, cancelling=True)


def test_a_cancel_asks_the_running_generation_to_stop_with_a_checkpoint() -> None:
    d = decide(snap(control={"cancel-1": cancel_req()}))
    assert kinds(d) == ["SetDirective", "ConsumeRequests", "SetStatus"]
    assert only(d, SetDirective).directive == Directive(generation=1, stop=True, reason="cancel",
                                                        time=NOW)
    assert only(d, ConsumeRequests).ids == ("cancel-1",)
    status = only(d, SetStatus).status
    assert status.cancelling and status.state == JobState.RUNNING
    assert status.reason.startswith("cancelling")
    assert d.wake_at == NOW + boundary_timeout(FAULT)


def test_cancelling_waits_for_the_boundary_and_starts_nothing() -> None:
    asked = Directive(generation=1, stop=True, reason="cancel", time=NOW - 5)
    d = decide(snap(directive=asked, status=cancelling(JobStatus(
        state=JobState.RUNNING, spec_revision=REV, reason="cancelling: stopping at the next "
        "step boundary after a durable checkpoint", time=NOW - 5))))
    assert d.actions == ()
    assert d.wake_at == NOW - 5 + boundary_timeout(FAULT)


def test_the_stopped_generation_makes_the_job_cancelled_not_replanned() -> None:
    d = decide(snap(progress=Progress(generation=1, step=44, stopped=True),
                    checkpoint=CheckpointRecord(generation=1, step=44, path="/ckpt/step-44"),
                    directive=Directive(generation=1, stop=True, reason="cancel", time=NOW - 5),
                    status=cancelling()))
    none_of(d, SetDirective)
    assert kinds(d) == ["SetStatus"]
    status = only(d, SetStatus).status
    assert status.state == JobState.CANCELLED
    assert status.reason == "cancelled at step 44 (last durable checkpoint: step 44)"


def test_cancelled_is_terminal_even_when_nodes_change() -> None:
    done = JobStatus(state=JobState.CANCELLED, reason="cancelled at step 44", cancelling=True,
                     spec_revision=REV, time=NOW - 5)
    stopped = Progress(generation=1, step=44, stopped=True)
    # A node joins (a bigger layout fits): still nothing starts.
    d = decide(snap(("a", "b"), members=("a", "b", "c"), progress=stopped, status=done))
    assert d.actions == ()


def test_a_new_submission_after_a_cancel_starts_afresh() -> None:
    done = JobStatus(state=JobState.CANCELLED, reason="cancelled at step 44", cancelling=True,
                     spec_revision=REV, time=NOW - 5)
    d = decide(snap(None, spec_revision=REV + 1, status=done, checkpoint=CheckpointRecord()))
    assert kinds(d) == ["StartGeneration", "SetStatus"]
    status = only(d, SetStatus).status
    assert status.state == JobState.RUNNING and not status.cancelling
    assert status.spec_revision == REV + 1


def test_a_cancel_of_an_earlier_submission_is_consumed_and_ignored() -> None:
    d = decide(snap(control={"cancel-1": cancel_req(REV - 1)}))
    assert kinds(d) == ["ConsumeRequests"]


@pytest.mark.parametrize("state", [JobState.FINISHED, JobState.FAILED])
def test_a_cancel_of_an_ended_job_changes_nothing(state: JobState) -> None:
    ended = JobStatus(state=state, reason="over", spec_revision=REV, time=NOW - 5)
    progress = Progress(generation=1, step=100, finished=state == JobState.FINISHED)
    d = decide(snap(progress=progress, status=ended, control={"cancel-1": cancel_req()}))
    assert kinds(d) == ["ConsumeRequests"]


def test_a_job_without_a_generation_is_cancelled_at_once() -> None:
    pending = JobStatus(state=JobState.PENDING, reason="needs 4 devices", spec_revision=REV,
                        time=NOW - 5)
    d = decide(snap(None, members=(), status=pending, control={"cancel-1": cancel_req()}))
    status = only(d, SetStatus).status
    assert status.state == JobState.CANCELLED
    assert status.reason == "cancelled before any generation started"


def test_a_generation_that_never_reaches_a_boundary_is_cancelled_without_a_checkpoint() -> None:
    asked = NOW - boundary_timeout(FAULT) - 1
    d = decide(snap(directive=Directive(generation=1, stop=True, reason="cancel", time=asked),
                    status=cancelling()))
    status = only(d, SetStatus).status
    assert status.state == JobState.CANCELLED
    assert "did not stop at a step boundary" in status.reason
    assert "last durable checkpoint: step 40" in status.reason


def test_a_failed_generation_while_cancelling_is_cancelled_not_retried() -> None:
    d = decide(snap(directive=Directive(generation=1, stop=True, reason="cancel", time=NOW - 5),
                    status=cancelling(), control={"f": failure_req()}))
    assert "StartGeneration" not in kinds(d)
    status = only(d, SetStatus).status
    assert status.state == JobState.CANCELLED
    assert status.reason == f"cancelled after generation 1 failed (last durable checkpoint: " \
                            f"step {CKPT.step})"


def test_a_planned_stop_under_way_serves_the_cancel() -> None:
    """A drain asked the generation to stop already: the cancel waits for that stop."""
    drain = Directive(generation=1, stop=True, reason="drain", time=NOW - 5)
    d = decide(snap(directive=drain, control={"cancel-1": cancel_req()}))
    none_of(d, SetDirective)
    assert only(d, SetStatus).status.cancelling


def test_a_finish_before_the_boundary_wins_over_the_cancel() -> None:
    d = decide(snap(progress=Progress(generation=1, step=100, finished=True),
                    status=cancelling()))
    assert only(d, SetStatus).status.state == JobState.FINISHED


def test_status_and_request_records_round_trip() -> None:
    status = cancelling()
    assert JobStatus.from_json(status.to_json()) == status
    req = cancel_req()
    assert ControlRequest.from_json(req.to_json()) == req
    assert ClusterFacts(now=0, ttl=1, job=None).status.cancelling is False
