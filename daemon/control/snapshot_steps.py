"""Which snapshot steps the cluster can restore, from the nodes' holdings records.

Pure functions of `snapshots/<node>` records (daemon/control/records.py), unit-tested:
- assemblable: every shard, the manifest and DCP's metadata are held by some live node, so a
  restore can read it now;
- complete: every shard and the manifest are held by two nodes at least (a primary and a buddy
  copy), so the step survives the loss of any one node; judged from the runs of replicated
  steps the members publish with their holdings;
- plausible: not beyond the newest step a node has seen by more than a small window, so a
  forged far-future step is neither kept by a node nor restored by the leader.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping

from daemon.control.records import HeldStep, SnapshotHoldings

# The window, in snapshot intervals, beyond the newest step a node has seen (its own workers'
# newest snapshot, the job's progress record, the step its generation restored) within which a
# snapshot step is plausible. Every step ends in collectives all ranks join, so no rank's
# snapshot of a step is written more than an interval or so before this node's own workers
# write theirs; the rest covers the progress record, written at most twice a second, when a
# node's own snapshots lag (they failed, or it holds none yet). A copy beyond it is refused
# by the keeper, and the leader never restores a step beyond it.
WINDOW_SNAPSHOTS = 4


def step_horizon(seen: int, snapshot_every: int) -> int:
    """The newest snapshot step that is plausible for a node that has seen step `seen`."""
    return max(seen, 0) + WINDOW_SNAPSHOTS * max(snapshot_every, 1)


def _by_step(holdings: Mapping[str, SnapshotHoldings]) -> dict[int, list[tuple[str, HeldStep]]]:
    by_step: dict[int, list[tuple[str, HeldStep]]] = {}
    for node, h in holdings.items():
        for held in h.steps:
            by_step.setdefault(held.step, []).append((node, held))
    return by_step


def _world(parts: list[tuple[str, HeldStep]]) -> int | None:
    """The step's world size, from the manifests among its holders (None: no manifest, or
    manifests that disagree)."""
    sizes = {held.world_size for _, held in parts if held.metadata and held.world_size > 0}
    return sizes.pop() if len(sizes) == 1 else None


def newest_assemblable(holdings: Mapping[str, SnapshotHoldings], limit: int | None = None
                       ) -> tuple[int, tuple[str, ...]]:
    """The newest snapshot step (not beyond `limit`, when given) whose every shard, manifest
    and metadata some node in `holdings` holds, and those nodes (sorted); (-1, ()) when there
    is none."""
    by_step = _by_step(holdings)
    for step in sorted(by_step, reverse=True):
        if limit is not None and step > limit:
            continue
        parts = by_step[step]
        world = _world(parts)
        if world is None:
            continue
        ranks = set().union(*(set(held.ranks) for _, held in parts))
        if ranks >= set(range(world)):
            return step, tuple(sorted(node for node, _ in parts))
    return -1, ()


def newest_complete(holdings: Mapping[str, SnapshotHoldings], generation: int,
                    members: Iterable[str]) -> int:
    """The newest step of `generation` whose every shard and manifest two nodes or more hold:
    the newest step inside every member's run of replicated steps (daemon/node/
    replication_run.py); -1: none known. A run names only steps whose part reached another
    node, so it stays true while its publication lags; two nodes' lists of held steps, each
    published on its own clock, need not overlap at all."""
    runs = []
    for node in set(members):
        h = holdings.get(node)
        if h is None or h.generation != generation or h.replicated_through < 0:
            return -1
        runs.append((h.replicated_since, h.replicated_through))
    if len(runs) < 2:
        return -1  # one node can never hold a second copy
    through = min(t for _, t in runs)
    return through if through >= max(s for s, _ in runs) else -1


def peers_holding(holdings: Mapping[str, SnapshotHoldings], step: int, rank: int | None,
                  planned: tuple[str, ...] = ()) -> list[str]:
    """Nodes to read rank `rank`'s shard (None: the manifest and metadata) of `step` from, most
    likely first: those whose holdings list it (sorted), then the `planned` ones not listed."""
    listed = [node for node, h in sorted(holdings.items())
              if any(held.step == step and (rank in held.ranks if rank is not None
                                            else held.metadata) for held in h.steps)]
    return listed + [node for node in planned if node not in listed]


def buddy_of(node: str, generation: Iterable[str], live: Container[str]) -> str | None:
    """Where `node` replicates its shards: the next node of the generation, in name order, that
    is alive (a ring: every node is some node's buddy); None when there is none."""
    ring = sorted(set(generation))
    if node not in ring:
        return None
    i = ring.index(node)
    return next((other for other in ring[i + 1:] + ring[:i] if other in live), None)
