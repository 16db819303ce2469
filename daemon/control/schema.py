"""What each key of a job's namespace holds, and the one decoder of its values.

The keys are `daemon/control/keys.py`'s; every value is a typed record of
`daemon/control/records.py` (JSON, parsed leniently), the generation's value a `Plan`, the
leader's the leading node's name. The cluster view (daemon/control/view.py), the events
renderer (daemon/api/events.py) and the leader read etcd values through `decode` and nothing
else, so a record is parsed one way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from daemon.control.keys import Keys
from daemon.control.records import (
    CheckpointRecord,
    ControlRequest,
    Cordon,
    Directive,
    JobSpec,
    JobStatus,
    NodeRecord,
    Progress,
    RendezvousRound,
    RestoreRecord,
    SnapshotHoldings,
)
from parallel.planner import Plan, PlanError

# Keys with one member per node or request: `<family>/<subject>`.
FAMILIES = ("nodes", "control", "snapshots", "cordons")
RECORDS: dict[str, type] = {
    "nodes": NodeRecord, "control": ControlRequest, "snapshots": SnapshotHoldings,
    "cordons": Cordon, "spec": JobSpec, "status": JobStatus, "progress": Progress,
    "checkpoint": CheckpointRecord, "directive": Directive, "restore": RestoreRecord,
    "rendezvous/round": RendezvousRound,
}


class MalformedRecord(ValueError):
    """A value that is not the record its key holds."""


@dataclass(frozen=True)
class Entry:
    """A key of the namespace: its `kind` (a family of FAMILIES, or the key's own name:
    "spec", "generation", "leader", ...) and, in a family, its `subject` (the node or the
    request id)."""

    kind: str
    subject: str = ""


def entry(keys: Keys, key: bytes) -> Entry:
    name = keys.relative(key)
    family, _, subject = name.partition("/")
    if family in FAMILIES and subject:
        return Entry(family, subject)
    return Entry(name)


def decode(kind: str, raw: bytes) -> Any:
    """`raw` as what a key of `kind` holds: a Plan for "generation", the node's name for
    "leader", else the record RECORDS names. MalformedRecord names the kind and what is wrong;
    a kind with no record is a KeyError."""
    try:
        if kind == "generation":
            return Plan.from_json(raw)
        if kind == "leader":
            return raw.decode()
        return RECORDS[kind].from_json(raw)
    except (PlanError, ValueError, TypeError, AttributeError) as exc:
        raise MalformedRecord(f"{kind}: {exc}") from None
