"""The typed etcd records: JSON round trips, lenient parsing of stray writes, node states."""

from __future__ import annotations

import json
from typing import Any

import pytest

from daemon.control.records import (
    CheckpointRecord,
    ControlOp,
    ControlRequest,
    Cordon,
    Directive,
    FailureKind,
    FailureRecord,
    JobSpec,
    JobState,
    JobStatus,
    NodeRecord,
    NodeState,
    Progress,
    Record,
)

pytestmark = pytest.mark.unit

FAILURES = (FailureRecord(3, 42, ("a", "b"), "a: boom", 9.5),
            FailureRecord(4, -1, (), "", 11.0))

SAMPLES: list[Record] = [
    NodeRecord("n1", "10.0.0.1:7400", "http://10.0.0.1:9400/metrics", 8, NodeState.DRAINING,
               1234, "1.2.3"),
    Progress(3, 120, 1920, 2.5, True, False, 1_700_000_000.5),
    CheckpointRecord(3, 100, "/ckpt/step-100"),
    Directive(3, True, 2, "join", 12.5),
    FAILURES[0],
    JobStatus(JobState.FAILED, "crash loop", FAILURES, 7, 12.0),
    ControlRequest(ControlOp.FAILURE, "b", 3, FailureKind.HANG, 42, "hung", 1.0),
    Cordon("b", "failed 3 times", 3.0),
    JobSpec({"train": {"steps": 5}, "job": {"name": "x"}}, "[train]\nsteps = 5\n",
            ("train.steps=5",), 4.0),
]

# Records whose every field has a default (NodeRecord has required fields).
DEFAULTABLE: list[type[Record]] = [Progress, CheckpointRecord, Directive, FailureRecord,
                                   JobStatus, ControlRequest, Cordon, JobSpec]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_round_trip(record: Record) -> None:
    raw = record.to_json()
    assert isinstance(raw, bytes)
    back = type(record).from_json(raw)
    assert back == record
    assert type(record).from_json(raw.decode()) == record
    # Sorted, compact JSON: the same record is the same bytes.
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    assert back.to_json() == raw


def test_enums_and_nested_failures_are_plain_json_and_typed_again() -> None:
    status = JobStatus(JobState.FAILED, "x", FAILURES, 7, 1.0)
    plain = json.loads(status.to_json())
    assert plain["state"] == "failed"
    assert plain["failures"][0] == {"generation": 3, "step": 42, "nodes": ["a", "b"],
                                    "cause": "a: boom", "time": 9.5}
    back = JobStatus.from_json(status.to_json())
    assert back.state is JobState.FAILED
    assert isinstance(back.failures, tuple) and all(isinstance(f, FailureRecord)
                                                    for f in back.failures)
    assert back.failures[0].nodes == ("a", "b")
    req = ControlRequest.from_json(ControlRequest(ControlOp.DRAIN, kind=FailureKind.LOST)
                                   .to_json())
    assert req.op is ControlOp.DRAIN and req.kind is FailureKind.LOST


GARBAGE: list[bytes | str] = [b"not json", b"[1, 2]", b"null", b"42", b'"text"', b"",
                              b"\xff\xfe", "{", "{}"]


@pytest.mark.parametrize("cls", DEFAULTABLE, ids=lambda c: c.__name__)
@pytest.mark.parametrize("raw", GARBAGE)
def test_garbage_reads_as_defaults(cls: type[Record], raw: bytes | str) -> None:
    assert cls.from_json(raw) == cls()


def test_a_node_record_without_its_required_fields_raises_type_error() -> None:
    # Its readers (view, events) catch ValueError and TypeError and skip the key.
    for raw in (b"not json", b"[]", b'{"node": "n1"}'):
        with pytest.raises(TypeError):
            NodeRecord.from_json(raw)


@pytest.mark.parametrize(("cls", "data", "expected"), [
    (Progress, {"step": "abc", "generation": 4}, Progress(generation=4)),
    (Progress, {"step": [1], "loss": "x", "time": None}, Progress()),
    (Progress, {"step": True, "generation": {"a": 1}}, Progress()),
    (Progress, {"step": 3, "from_a_newer_agent": 1}, Progress(step=3)),
    (Directive, {"checkpoint_seq": "many", "stop": True}, Directive(stop=True)),
    (CheckpointRecord, {"step": None, "path": "/p"}, CheckpointRecord(path="/p")),
    (JobStatus, {"state": "bogus", "spec_revision": 3}, JobStatus(spec_revision=3)),
    (JobStatus, {"state": 5, "failures": 5}, JobStatus()),
    (JobStatus, {"failures": [1, "x", None, {"generation": 2, "step": "?"}]},
     JobStatus(failures=(FailureRecord(generation=2),))),
    (ControlRequest, {"op": "explode", "kind": "weird", "node": "b"}, ControlRequest(node="b")),
    (FailureRecord, {"nodes": 5, "step": 7}, FailureRecord(step=7)),
    (NodeRecord, {"node": "n", "address": "a", "metrics_url": "m", "devices": 2,
                  "state": "asleep", "pid": "x"}, NodeRecord("n", "a", "m", 2)),
])
def test_mistyped_fields_read_as_defaults(cls: type[Record], data: dict[str, Any],
                                          expected: Record) -> None:
    assert cls.from_json(json.dumps(data)) == expected


@pytest.mark.parametrize(("cls", "data"), [
    (Progress, {"finished": "false"}),
    (JobStatus, {"reason": None}),
    (FailureRecord, {"nodes": "abc"}),
    (Progress, {"step": 5.5}),
    (JobSpec, {"submitted_at": "yesterday"}),
    (JobSpec, {"overrides": 5}),
], ids=["bool-from-str", "str-from-null", "tuple-from-str", "int-from-float",
        "spec-float", "spec-overrides"])
def test_values_of_the_wrong_kind_are_not_converted(cls: type[Record],
                                                     data: dict[str, Any]) -> None:
    assert cls.from_json(json.dumps(data)) == cls()


def test_with_state_accepts_states_and_their_names() -> None:
    record = NodeRecord("n1", "addr", "url", 1)
    assert record.with_state("draining").state is NodeState.DRAINING
    assert record.with_state(NodeState.CORDONED).state is NodeState.CORDONED
    assert record.with_state("cordoned").node == "n1"


def test_with_state_rejects_an_unknown_state_naming_the_allowed_ones() -> None:
    with pytest.raises(ValueError) as info:
        NodeRecord("n1", "addr", "url", 1).with_state("asleep")
    message = str(info.value)
    assert "'asleep'" in message
    for state in NodeState:
        assert state.value in message
