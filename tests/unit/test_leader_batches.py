"""The leader writes adjacent plain actions of one decision in one etcd transaction, in order,
and never puts a generation's write or a probe into a batch."""

from __future__ import annotations

import pytest

from daemon.control.facts import (
    ConsumeRequests,
    ProbeNodes,
    SetDirective,
    SetStatus,
    StartGeneration,
)
from daemon.control.leader import _MAX_BATCH_WRITES, _batches
from daemon.control.records import Directive, JobStatus

pytestmark = pytest.mark.unit


def test_a_failure_round_consumes_and_records_in_one_batch_after_its_probe() -> None:
    probe, consume = ProbeNodes(("a", "b")), ConsumeRequests(("r1", "r2"))
    status = SetStatus(JobStatus())
    assert _batches([probe, consume, status]) == [[probe], [consume, status]]


def test_a_generation_write_stays_alone_and_first() -> None:
    start = StartGeneration(plan=object(), reason="leave")  # type: ignore[arg-type]
    status, directive = SetStatus(JobStatus()), SetDirective(Directive())
    assert _batches([start, status, directive]) == [[start], [status, directive]]
    assert _batches([status, start, directive]) == [[status], [start], [directive]]


def test_a_batch_holds_at_most_the_write_limit() -> None:
    many = ConsumeRequests(tuple(f"r{i}" for i in range(_MAX_BATCH_WRITES)))
    status = SetStatus(JobStatus())
    assert _batches([many, status]) == [[many], [status]]
    assert _batches([status, ConsumeRequests(("r",))]) == [[status, ConsumeRequests(("r",))]]
