"""Typed values of the job's keys in etcd (docs/architecture.md, "etcd keys").

Every value is a frozen dataclass that serialises to sorted, compact JSON and parses back
leniently: unknown fields are ignored (a newer agent may add some) and a value that is not a
JSON object at all reads as the record's defaults, so a stray write can never crash an agent.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

R = TypeVar("R", bound="Record")


def dumps(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def loads(raw: bytes | str) -> dict[str, Any]:
    """A JSON object from etcd; anything else (a stray write) reads as empty."""
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class Record:
    """JSON (de)serialisation shared by the records below."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> bytes:
        return dumps(_plain(self.to_dict()))

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            f = fields.get(name)
            if f is None:
                continue
            try:
                kwargs[name] = _coerce(f.type, value)
            except (TypeError, ValueError):
                continue  # a mistyped field reads as its default
        return cls(**kwargs)

    @classmethod
    def from_json(cls: type[R], raw: bytes | str) -> R:
        return cls.from_dict(loads(raw))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


_SCALARS: dict[str, type] = {"int": int, "float": float}


def _coerce(type_name: Any, value: Any) -> Any:
    name = type_name if isinstance(type_name, str) else getattr(type_name, "__name__", "")
    if name == "bool":
        if not isinstance(value, bool):
            raise TypeError(name)
        return value
    if name == "str":
        if not isinstance(value, str):
            raise TypeError(name)
        return value
    if name in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(name)
        if name == "int" and value != int(value):
            raise TypeError(name)
        return _SCALARS[name](value)
    enums = {e.__name__: e for e in (NodeState, JobState, ControlOp, FailureKind)}
    if name in enums:
        return enums[name](value)
    if not name.startswith("tuple[") or not isinstance(value, list):
        raise TypeError(name)
    if name == "tuple[FailureRecord, ...]":
        return tuple(FailureRecord.from_dict(v) for v in value if isinstance(v, dict))
    if name == "tuple[str, ...]":
        return tuple(v for v in value if isinstance(v, str))
    if name == "tuple[int, ...]":
        return tuple(int(v) for v in value if isinstance(v, int) and not isinstance(v, bool))
    if name == "tuple[HeldStep, ...]":
        return tuple(HeldStep.from_dict(v) for v in value if isinstance(v, dict))
    raise TypeError(name)


class NodeState(str, enum.Enum):
    """An operator's intent for a node (kubectl's cordon/drain, in etcd)."""

    READY = "ready"
    DRAINING = "draining"    # leave at the next agreed step boundary
    CORDONED = "cordoned"    # keep running work, take no place in new generations


@dataclass(frozen=True)
class NodeRecord(Record):
    """`nodes/<node>`, written by the node's own agent under its lease."""

    node: str
    address: str
    metrics_url: str
    devices: int
    state: NodeState = NodeState.READY
    pid: int = 0
    version: str = ""
    device_memory: int = 0   # bytes per device (ultrad --device-memory); 0: unknown

    def with_state(self, state: NodeState | str) -> NodeRecord:
        try:
            return dataclasses.replace(self, state=NodeState(state))
        except ValueError:
            allowed = ", ".join(s.value for s in NodeState)
            raise ValueError(f"node state must be one of {allowed} (got {state!r})") from None


@dataclass(frozen=True)
class Progress(Record):
    """`progress`: the last step rank 0 completed, written by rank 0's agent, fenced by the
    generation it reports (a straggler of an older generation cannot overwrite a newer one)."""

    generation: int = 0
    step: int = 0
    consumed_samples: int = 0
    loss: float = 0.0
    finished: bool = False   # the job's last step is done
    stopped: bool = False    # the generation left at a planned boundary, checkpointed
    time: float = 0.0        # wall clock of the writer
    # The newest complete snapshot step as rank 0's agent saw the holdings at this step: every
    # shard and the manifest held by two nodes at least (daemon/control/snapshot_steps.py).
    # -1: none known yet in this generation.
    snapshot_complete: int = -1
    # The newest step of the generation whose update every rank skipped (trainer/nonfinite.py),
    # and why; 0: none. Each new one is an event (`ultractl events`).
    skipped_step: int = 0
    skipped_reason: str = ""
    # The newest step of the generation followed by an [eval] pass (trainer/evaluation.py), and
    # its held-out loss; 0: none. Each new one is an event.
    eval_step: int = 0
    eval_loss: float = 0.0


@dataclass(frozen=True)
class CheckpointRecord(Record):
    """`checkpoint`: the newest durable checkpoint every rank committed."""

    generation: int = 0
    step: int = -1           # -1: none yet
    path: str = ""
    time: float = 0.0        # wall clock of the writer when it learnt of the commit


@dataclass(frozen=True)
class RestoreRecord(Record):
    """`restore`: what the generation's workers loaded, written by rank 0's agent (fenced by
    the generation, like `progress`), so why a tier was skipped is in `ultractl events`."""

    generation: int = 0
    source: str = ""         # init | checkpoint | snapshot: what was loaded
    step: int = 0
    planned: str = ""        # what the plan named, "source@step"
    skipped: str = ""        # why the plan's snapshot was not used
    seconds: float = 0.0
    snapshot_bytes: int = 0  # rank 0's bytes read from snapshots


@dataclass(frozen=True)
class HeldStep(Record):
    """One snapshot step a node holds in its memory (docs/snapshots.md)."""

    step: int = 0
    ranks: tuple[int, ...] = ()   # shards held: the node's own and buddy copies
    world_size: int = 0           # from the manifest; 0 while this node has none
    metadata: bool = False        # the manifest and DCP's .metadata are held here


@dataclass(frozen=True)
class SnapshotHoldings(Record):
    """`snapshots/<node>`: what a node's agent holds, under its lease (gone with the node)."""

    node: str = ""
    address: str = ""             # where peers read it (the agent's gRPC address)
    steps: tuple[HeldStep, ...] = ()
    spec_revision: int = 0        # the job submission they are snapshots of
    # This node's unbroken run of replicated steps in `generation` (daemon/node/replication_run.py)
    generation: int = 0
    replicated_since: int = -1
    replicated_through: int = -1  # -1: none yet


@dataclass(frozen=True)
class Directive(Record):
    """`directive`: the leader's standing requests to the running generation.

    Workers agree on each field inside every step (trainer/agreement.py): a request one rank
    saw in the reply to step n takes effect at step n + 1, the same step everywhere.
    """

    generation: int = 0
    stop: bool = False        # planned change: checkpoint, then leave the generation
    checkpoint_seq: int = 0   # checkpoint requests so far in this generation
    reason: str = ""
    time: float = 0.0         # when `stop` was first asked (the leader's clock)


class JobState(str, enum.Enum):
    NONE = "none"            # no job submitted
    PENDING = "pending"      # the ready nodes cannot host the job (reason says why)
    RUNNING = "running"
    FAILED = "failed"        # stopped retrying: the reason is the cause
    FINISHED = "finished"
    CANCELLED = "cancelled"  # `ultractl job cancel`: stopped at a step boundary, checkpointed


# States a job does not leave until a new submission.
ENDED = frozenset({JobState.FAILED, JobState.FINISHED, JobState.CANCELLED})


class FailureKind(str, enum.Enum):
    EXIT = "exit"            # a worker process died (node implicated)
    HANG = "hang"            # a worker made no progress and was killed (node implicated)
    LOCAL = "local"          # a worker's own error: data, disk, a bug (node implicated)
    PEER = "peer"            # a collective failed because of another rank (nobody implicated)
    LOST = "lost"            # a member's agent is gone (node implicated)
    STORAGE = "storage"      # checkpoint dir not shared, or split over nodes: no retry helps
    DISK = "disk"            # the checkpoint filesystem failed (full, read-only): nobody to blame
    DIVERGED = "diverged"    # train.max_skipped_steps non-finite steps in a row: no retry helps


IMPLICATING = frozenset({FailureKind.EXIT, FailureKind.HANG, FailureKind.LOCAL,
                         FailureKind.LOST, FailureKind.STORAGE})


@dataclass(frozen=True)
class FailureRecord(Record):
    """One failed generation: every report about it, merged."""

    generation: int = 0
    step: int = -1                    # the earliest step a report named (-1: unknown)
    nodes: tuple[str, ...] = ()       # nodes implicated (sorted)
    cause: str = ""                   # the first implicating report's message
    time: float = 0.0


@dataclass(frozen=True)
class JobStatus(Record):
    """`status`: the job's state for operators, and the failures since the last progress.

    Written by the leader only (fenced), so a new leader continues the count where the old one
    stopped: a crash loop cannot escape its limit by killing the leader.
    """

    state: JobState = JobState.NONE
    reason: str = ""
    failures: tuple[FailureRecord, ...] = ()
    spec_revision: int = 0            # the job submission this status is about
    time: float = 0.0
    # `ultractl job cancel` was consumed: the running generation stops at a step boundary with a
    # durable checkpoint and the job becomes `cancelled` (decide.py).
    cancelling: bool = False


class ControlOp(str, enum.Enum):
    DRAIN = "drain"
    CORDON = "cordon"
    UNCORDON = "uncordon"
    CHECKPOINT = "checkpoint"
    FAILURE = "failure"
    CANCEL = "cancel"

    @property
    def node_op(self) -> bool:
        """Applied by the node it names rather than by the leader."""
        return self in (ControlOp.DRAIN, ControlOp.CORDON, ControlOp.UNCORDON)

    @property
    def node_state(self) -> NodeState:
        """The state a node op puts its node in."""
        return {ControlOp.DRAIN: NodeState.DRAINING, ControlOp.CORDON: NodeState.CORDONED,
                ControlOp.UNCORDON: NodeState.READY}[self]


@dataclass(frozen=True)
class ControlRequest(Record):
    """`control/<id>`: a request to the node it names or to the leader; deleted once applied."""

    op: ControlOp = ControlOp.CHECKPOINT
    node: str = ""
    generation: int = 0
    kind: FailureKind = FailureKind.PEER
    step: int = -1
    message: str = ""
    time: float = 0.0
    # A hang: the hung worker's Python stacks (their last 4 KiB), or why there are none.
    stacks: str = ""
    # A cancel: the job submission (spec mod revision) it is about; a newer one is not cancelled.
    spec_revision: int = 0


@dataclass(frozen=True)
class Cordon(Record):
    """`cordons/<node>`: the leader's cordon of a node that kept failing; survives the node's
    restarts (its own `nodes/` record does not). `ultractl uncordon` removes it."""

    node: str = ""
    reason: str = ""
    time: float = 0.0


@dataclass(frozen=True)
class JobSpec(Record):
    """`spec`: the submitted job, validated by SubmitJob."""

    config: dict[str, Any] = field(default_factory=dict)
    toml: str = ""
    overrides: tuple[str, ...] = ()
    submitted_at: float = 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        config = data.get("config")
        scalars = Record.from_dict.__func__(_JobSpecScalars, data)  # type: ignore[attr-defined]
        return cls(config=dict(config) if isinstance(config, dict) else {}, toml=scalars.toml,
                   overrides=scalars.overrides, submitted_at=scalars.submitted_at)


@dataclass(frozen=True)
class _JobSpecScalars(Record):
    """JobSpec's typed fields, parsed by the shared rules (its `config` is free-form)."""

    toml: str = ""
    overrides: tuple[str, ...] = ()
    submitted_at: float = 0.0


@dataclass(frozen=True)
class RendezvousRound(Record):
    """`rendezvous/round`: what plain torchrun's rendezvous state says (daemon/rendezvous/),
    written in the same txn as the state itself, so readers never unpickle torch's state.
    Nodes are named as torch names them: `host_pid_local-id`."""

    round: int = 0
    complete: bool = False
    closed: bool = False
    participants: tuple[str, ...] = ()   # in rank order
    waiting: tuple[str, ...] = ()        # joined, for the next round
    redundant: tuple[str, ...] = ()      # beyond max nodes, for the next round
    min_nodes: int = 0
    max_nodes: int = 0
    time: float = 0.0                    # wall clock of the writer
