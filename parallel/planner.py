"""The planner: (job, members) → the plan of one generation.

Pure (no torch, no I/O) so the agent can call it on every membership change. The plan is what
the leader writes to etcd's `generation` key and what every worker reads to join the mesh
(docs/architecture.md, "The plan"). For now dp = usable devices and tp/pp/cp are fixed by
the job (`parallel.layout.resolve`); a later issue grows the search and the predictions.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from parallel import job as jobmod
from parallel.job import ConfigError, JobConfig
from parallel.layout import Layout, predicted_bubble, resolve
from parallel.memory_model import peak_memory

USABLE_STATE = "ready"
RESTORE_SOURCES = ("init", "checkpoint", "snapshot")


class PlanError(ValueError):
    """The members cannot host the job; the message says why."""


@dataclass(frozen=True)
class NodeInfo:
    node: str
    devices: int
    state: str = USABLE_STATE


@dataclass(frozen=True)
class RankInfo:
    node: str
    local_rank: int
    global_rank: int


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int
    # Key prefix of the generation in the store: unique per written plan, so a rendezvous can
    # never meet keys of another run, even if a generation number is reused (etcd restored).
    prefix: str = ""


@dataclass(frozen=True)
class Restore:
    source: str = "init"
    step: int = 0
    locations: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.source not in RESTORE_SOURCES:
            raise PlanError(
                f"restore.source must be one of {RESTORE_SOURCES} (got {self.source!r})"
            )
        if self.step < 0:
            raise PlanError(f"restore.step must be >= 0 (got {self.step})")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Restore:
        return cls(source=str(raw.get("source", "init")), step=int(raw.get("step", 0)),
                   locations=tuple(str(x) for x in raw.get("locations", ())))


@dataclass(frozen=True)
class MemoryBytes:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0


@dataclass(frozen=True)
class Predicted:
    """What the plan expects per device: the memory model's peak device (parallel.memory_model),
    the bubble; recompute_ratio stays 0 until the cost model fills it."""

    memory_bytes: MemoryBytes = field(default_factory=MemoryBytes)
    bubble_ratio: float = 0.0
    recompute_ratio: float = 0.0


@dataclass(frozen=True)
class Plan:
    generation: int
    job: JobConfig
    layout: Layout
    ranks: tuple[RankInfo, ...]
    store: StoreAddress
    restore: Restore = field(default_factory=Restore)
    predicted: Predicted = field(default_factory=Predicted)
    # Ready nodes the layout could not use (e.g. tp x pp x cp does not divide their devices).
    idle: tuple[str, ...] = ()
    # Why this generation exists (start, join, leave, drain, failure, job): metrics and events.
    reason: str = ""

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @functools.cached_property
    def nodes(self) -> tuple[str, ...]:
        """Member nodes in rank order (computed once: agents ask on every view change)."""
        return tuple(self._ranks_by_node)

    def ranks_of(self, node: str) -> tuple[RankInfo, ...]:
        return self._ranks_by_node.get(node, ())

    @functools.cached_property
    def _ranks_by_node(self) -> dict[str, tuple[RankInfo, ...]]:
        by_node: dict[str, list[RankInfo]] = {}
        for r in self.ranks:
            by_node.setdefault(r.node, []).append(r)
        return {node: tuple(ranks) for node, ranks in by_node.items()}

    def to_dict(self) -> dict[str, Any]:
        m = self.predicted.memory_bytes
        return {
            "generation": self.generation,
            "job": self.job.to_dict(),
            "layout": self.layout.to_dict(),
            "ranks": [{"node": r.node, "local_rank": r.local_rank, "global_rank": r.global_rank}
                      for r in self.ranks],
            "store": {"host": self.store.host, "port": self.store.port,
                      "prefix": self.store.prefix},
            "restore": {"source": self.restore.source, "step": self.restore.step,
                        "locations": list(self.restore.locations)},
            "predicted": {
                "memory_bytes": {"params": m.params, "grads": m.grads,
                                 "optimizer": m.optimizer, "activations": m.activations},
                "bubble_ratio": self.predicted.bubble_ratio,
                "recompute_ratio": self.predicted.recompute_ratio,
            },
            "idle": list(self.idle),
            "reason": self.reason,
        }

    def to_json(self) -> str:
        # sort_keys: the same plan is the same bytes, so agents can compare values cheaply.
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Plan:
        try:
            pred = raw.get("predicted", {})
            return cls(
                generation=int(raw["generation"]),
                job=jobmod.from_dict(raw["job"]),
                layout=Layout.from_dict(dict(raw["layout"])),
                ranks=tuple(RankInfo(str(r["node"]), int(r["local_rank"]), int(r["global_rank"]))
                            for r in raw["ranks"]),
                store=StoreAddress(str(raw["store"]["host"]), int(raw["store"]["port"]),
                                   str(raw["store"].get("prefix", ""))),
                restore=Restore.from_dict(raw.get("restore", {})),
                predicted=Predicted(
                    memory_bytes=MemoryBytes(**pred.get("memory_bytes", {})),
                    bubble_ratio=float(pred.get("bubble_ratio", 0.0)),
                    recompute_ratio=float(pred.get("recompute_ratio", 0.0)),
                ),
                idle=tuple(str(n) for n in raw.get("idle", ())),
                reason=str(raw.get("reason", "")),
            )
        except (KeyError, TypeError) as exc:
            raise PlanError(f"malformed plan: missing or mistyped field {exc}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"malformed plan: not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise PlanError("malformed plan: not a JSON object")
        return cls.from_dict(raw)


def predict(job: JobConfig, layout: Layout) -> Predicted:
    """The plan's predictions for `layout`: memory of its fullest device, and the bubble."""
    m = peak_memory(job.model, layout, job.train.seq_len)
    return Predicted(memory_bytes=MemoryBytes(m.params, m.grads, m.optimizer, m.activations),
                     bubble_ratio=predicted_bubble(layout))


def usable_nodes(nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """Ready nodes with devices, sorted by id: the order ranks are assigned in."""
    ids = [n.node for n in nodes]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise PlanError(f"duplicate node id(s): {', '.join(duplicates)}")
    return sorted((n for n in nodes if n.state == USABLE_STATE and n.devices > 0),
                  key=lambda n: n.node)


def plan_generation(
    job: JobConfig,
    nodes: Sequence[NodeInfo],
    generation: int,
    store: tuple[str, int],
    restore: Mapping[str, Any] | None = None,
    reason: str = "",
) -> Plan:
    """The plan of `generation` for `job` on the ready `nodes`.

    Ranks are node-major (a node's devices get consecutive global ranks, nodes in id order) so a
    TP group, innermost in the mesh, never spans nodes. When the whole world cannot host the
    job, the longest prefix of the id-ordered nodes that can is used and the rest are `idle`;
    keeping whole nodes in id order keeps the choice deterministic across agents.
    """
    if generation < 1:
        raise PlanError(f"generation must be >= 1 (got {generation})")
    usable = usable_nodes(nodes)
    if not usable:
        raise PlanError("no ready node with devices")
    first_error: ConfigError | None = None
    for count in range(len(usable), 0, -1):
        members = usable[:count]
        try:
            # Every node's device count a multiple of tp keeps each TP group inside one node.
            per_node = math.gcd(*(n.devices for n in members))
            layout = resolve(job, sum(n.devices for n in members), devices_per_node=per_node)
        except ConfigError as exc:
            first_error = first_error or exc
            continue
        ranks: list[RankInfo] = []
        for n in members:
            base = len(ranks)
            ranks.extend(RankInfo(n.node, local, base + local) for local in range(n.devices))
        return Plan(
            generation=generation, job=job, layout=layout, ranks=tuple(ranks),
            store=StoreAddress(store[0], int(store[1])),
            restore=Restore.from_dict(restore or {}),
            predicted=predict(job, layout),
            idle=tuple(n.node for n in usable[count:]), reason=reason,
        )
    raise PlanError(f"no subset of the {len(usable)} ready node(s) can host the job: {first_error}")
