"""What the leader's decision function reads (`ClusterFacts`: the cluster view, the job and
the time, as of one moment) and returns (`Decision`, actions).

Plain frozen data, so decisions are compared and tested as values (decide.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union

from daemon.control.records import (
    CheckpointRecord,
    ControlRequest,
    Cordon,
    Directive,
    JobStatus,
    NodeState,
    Progress,
    SnapshotHoldings,
)
from parallel.job import JobConfig
from parallel.planner import Plan


@dataclass(frozen=True)
class MemberInfo:
    devices: int
    state: NodeState = NodeState.READY
    device_memory: int = 0  # bytes per device; 0: unknown


@dataclass(frozen=True)
class ProbeResult:
    alive: bool
    at: float


@dataclass(frozen=True)
class ClusterFacts:
    """What the leader knows at `now` (its own wall clock)."""

    now: float
    ttl: float
    job: JobConfig | None
    spec_revision: int = 0
    members: Mapping[str, MemberInfo] = field(default_factory=dict)
    cordons: Mapping[str, Cordon] = field(default_factory=dict)
    plan: Plan | None = None
    progress: Progress = field(default_factory=Progress)
    checkpoint: CheckpointRecord = field(default_factory=CheckpointRecord)
    directive: Directive = field(default_factory=Directive)
    status: JobStatus = field(default_factory=JobStatus)
    control: Mapping[str, ControlRequest] = field(default_factory=dict)
    # Members of the running generation without a node key, since when (leader's clock), and
    # the latest probe of each.
    missing_since: Mapping[str, float] = field(default_factory=dict)
    probes: Mapping[str, ProbeResult] = field(default_factory=dict)
    # What each member holds of in-memory snapshots (docs/snapshots.md).
    holdings: Mapping[str, SnapshotHoldings] = field(default_factory=dict)


@dataclass(frozen=True)
class SetStatus:
    status: JobStatus


@dataclass(frozen=True)
class SetDirective:
    directive: Directive


@dataclass(frozen=True)
class StartGeneration:
    """Write the next generation: `plan` has no number or store yet (the leader assigns them)."""

    plan: Plan
    reason: str


@dataclass(frozen=True)
class CordonNodes:
    cordons: tuple[Cordon, ...]


@dataclass(frozen=True)
class ProbeNodes:
    """Health-check these agents; revoke the lease of any that does not answer."""

    nodes: tuple[str, ...]


@dataclass(frozen=True)
class ConsumeRequests:
    ids: tuple[str, ...]


Action = Union[SetStatus, SetDirective, StartGeneration, CordonNodes, ProbeNodes,  # noqa: UP007
               ConsumeRequests]


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...] = ()
    wake_at: float | None = None  # look again at this time even if nothing changes
