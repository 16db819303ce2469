"""The planner: (job, members) → the plan of one generation.

Pure (no torch, no I/O) so the agent can call it on every membership change. The plan is what
the leader writes to etcd's `generation` key and what every worker reads to join the mesh
(docs/architecture.md, "The plan"). dp follows the ready devices; the other dimensions are the
job's, unless the job lets the planner change some (`parallel.replan`) and its own layout cannot
run on the ready nodes or fit their memory: then the layout search chooses (docs/planner.md,
"Re-planning a running job").
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
from parallel.layout_search import Choice, SearchSpace, World, search_layout
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
    reason: str = ""  # why this tier (e.g. why not the in-memory snapshots)
    # The newest durable checkpoint the leader has recorded, whatever the source (0: none):
    # the step a fallback from the snapshot must reach when checkpoint.storage is "node".
    checkpoint_step: int = 0

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
                   locations=tuple(str(x) for x in raw.get("locations", ())),
                   reason=str(raw.get("reason", "")),
                   checkpoint_step=int(raw.get("checkpoint_step", 0)))


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
    # Host memory the in-memory snapshots take on the fullest node (0: snapshots off); see
    # `snapshot_host_bytes`.
    snapshot_host_bytes: int = 0


# Snapshot steps a node holds at once: the two newest complete ones and the one being written.
SNAPSHOT_STEPS_HELD = 3


def snapshot_host_bytes(job: JobConfig, memory: MemoryBytes, ranks_per_node: int) -> int:
    """Predicted host memory of a node's snapshots (docs/snapshots.md): each rank's shard is its
    model state and optimizer state (the fullest device's, so an upper bound), the node holds
    its own ranks' shards and its buddy node's as many, for SNAPSHOT_STEPS_HELD steps. With
    bf16 the parameters are counted at their training dtype plus the fp32 master copy the
    optimizer holds, which a snapshot stores once: an overestimate of about 15%."""
    if job.checkpoint.snapshot_every <= 0:
        return 0
    return SNAPSHOT_STEPS_HELD * 2 * ranks_per_node * (memory.params + memory.optimizer)


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
    # Why this generation exists (start, join, leave, drain, failure, job, layout): metrics and
    # events.
    reason: str = ""
    # Set when the layout is not the job's own (`parallel.replan`): which layout and why.
    layout_reason: str = ""

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
                        "locations": list(self.restore.locations),
                        **({"reason": self.restore.reason} if self.restore.reason else {}),
                        **({"checkpoint_step": self.restore.checkpoint_step}
                           if self.restore.checkpoint_step else {})},
            "predicted": {
                "memory_bytes": {"params": m.params, "grads": m.grads,
                                 "optimizer": m.optimizer, "activations": m.activations},
                "bubble_ratio": self.predicted.bubble_ratio,
                "recompute_ratio": self.predicted.recompute_ratio,
                "snapshot_host_bytes": self.predicted.snapshot_host_bytes,
            },
            "idle": list(self.idle),
            "reason": self.reason,
            "layout_reason": self.layout_reason,
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
                    snapshot_host_bytes=int(pred.get("snapshot_host_bytes", 0)),
                ),
                idle=tuple(str(n) for n in raw.get("idle", ())),
                reason=str(raw.get("reason", "")),
                layout_reason=str(raw.get("layout_reason", "")),
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


def predict(job: JobConfig, layout: Layout, ranks_per_node: int = 1) -> Predicted:
    """The plan's predictions for `layout`: memory of its fullest device, the bubble, and the
    host memory of a node's snapshots."""
    m = peak_memory(job.model, layout, job.train.seq_len)
    memory = MemoryBytes(m.params, m.grads, m.optimizer, m.activations)
    return Predicted(memory_bytes=memory, bubble_ratio=predicted_bubble(layout),
                     snapshot_host_bytes=snapshot_host_bytes(job, memory, ranks_per_node))


def usable_nodes(nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """Ready nodes with devices, sorted by id: the order ranks are assigned in."""
    ids = [n.node for n in nodes]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise PlanError(f"duplicate node id(s): {', '.join(duplicates)}")
    return sorted((n for n in nodes if n.state == USABLE_STATE and n.devices > 0),
                  key=lambda n: n.node)


@dataclass(frozen=True)
class _Fit:
    layout: Layout
    members: int  # how many of the id-ordered usable nodes it uses
    note: str = ""


def _fit_prefix(job: JobConfig, usable: Sequence[NodeInfo], budget: int) -> _Fit | str:
    """`job`'s own layout on the longest prefix of `usable` that hosts it within `budget` bytes
    per device (0: no limit); else the first reason."""
    first_error = ""
    for count in range(len(usable), 0, -1):
        members = usable[:count]
        try:
            # Every node's device count a multiple of tp keeps each TP group inside one node.
            per_node = math.gcd(*(n.devices for n in members))
            layout = resolve(job, sum(n.devices for n in members), devices_per_node=per_node)
        except ConfigError as exc:
            first_error = first_error or str(exc)
            continue
        if budget:
            need = peak_memory(job.model, layout, job.train.seq_len).total
            if need > budget:
                first_error = first_error or (
                    f"predicted memory {need / 1e9:.3g} GB per device > {budget / 1e9:.3g} GB "
                    f"on {count} node(s)")
                continue
        return _Fit(layout, count)
    return first_error


def _search(job: JobConfig, usable: Sequence[NodeInfo], budget: int) -> _Fit | str:
    """The layout search over `job.parallel.replan` on the longest prefix of `usable` that has a
    valid layout; else why not."""
    space = SearchSpace.from_job(job, free=job.parallel.replan)
    for count in range(len(usable), 0, -1):
        per_node = math.gcd(*(n.devices for n in usable[:count]))
        world = World(sum(n.devices for n in usable[:count]) // per_node, per_node)
        result = search_layout(job, world, budget or 1 << 62, space)
        if result.best is not None:
            assert result.best.layout is not None
            return _Fit(result.best.layout, count)
    reasons = "; ".join(f"{kind} ({n})" for kind, n in result.reason_counts())
    return f"no layout over {', '.join(job.parallel.replan)} is valid either: {reasons}"


def _layout_for(
    job: JobConfig, usable: Sequence[NodeInfo], budget: int, current: Layout | None
) -> _Fit:
    """The job's own layout when it fits; else the running (re-planned) layout when it still
    fits, since keeping it keeps the reshard cheap; else, with `parallel.replan`, the search."""
    # A memory bound applies to jobs that let the planner choose; others run as written.
    budget = budget if job.parallel.replan else 0
    own = _fit_prefix(job, usable, budget)
    if isinstance(own, _Fit):
        if not job.parallel.replan:
            return own
        # Say why nothing was searched: keeping the job's dimensions is the cheaper reshard.
        return _Fit(own.layout, own.members,
                    f"the job's {Choice.of(job.parallel).describe()} kept: valid on "
                    f"{own.members} of {len(usable)} ready node(s)")
    why = f"the job's {Choice.of(job.parallel).describe()} cannot run: {own}"
    if not job.parallel.replan:
        raise PlanError(f"no subset of the {len(usable)} ready node(s) can host the job: {own}")
    if current is not None:
        kept = _fit_prefix(Choice.of(current).parallel(job), usable, budget)
        if isinstance(kept, _Fit):
            return _Fit(kept.layout, kept.members,
                        f"kept {Choice.of(current).describe()} ({why})")
    found = _search(job, usable, budget)
    if isinstance(found, str):
        raise PlanError(f"{why}; {found}")
    return _Fit(found.layout, found.members,
                f"re-planned to {Choice.of(found.layout).describe()} over "
                f"{', '.join(job.parallel.replan)} ({why})")


def plan_generation(
    job: JobConfig,
    nodes: Sequence[NodeInfo],
    generation: int,
    store: tuple[str, int],
    restore: Mapping[str, Any] | None = None,
    reason: str = "",
    current: Layout | None = None,
    memory_per_device: int = 0,
) -> Plan:
    """The plan of `generation` for `job` on the ready `nodes`.

    Ranks are node-major (a node's devices get consecutive global ranks, nodes in id order) so a
    TP group, innermost in the mesh, never spans nodes. When the whole world cannot host the
    job, the longest prefix of the id-ordered nodes that can is used and the rest are `idle`;
    keeping whole nodes in id order keeps the choice deterministic across agents.

    The layout is the job's own whenever some prefix hosts it within `memory_per_device` bytes
    (0: unknown, not checked). Otherwise, if the job lets the planner change dimensions
    (`parallel.replan`): `current`, the running generation's layout, while it still fits, then
    the best layout of the search; `layout_reason` says which and why.
    """
    if generation < 1:
        raise PlanError(f"generation must be >= 1 (got {generation})")
    usable = usable_nodes(nodes)
    if not usable:
        raise PlanError("no ready node with devices")
    fit = _layout_for(job, usable, memory_per_device, current)
    ranks: list[RankInfo] = []
    for n in usable[: fit.members]:
        base = len(ranks)
        ranks.extend(RankInfo(n.node, local, base + local) for local in range(n.devices))
    return Plan(
        generation=generation, job=job, layout=fit.layout, ranks=tuple(ranks),
        store=StoreAddress(store[0], int(store[1])),
        restore=Restore.from_dict(restore or {}),
        predicted=predict(job, fit.layout,
                          max((n.devices for n in usable[: fit.members]), default=1)),
        idle=tuple(n.node for n in usable[fit.members:]), reason=reason,
        layout_reason=fit.note,
    )
