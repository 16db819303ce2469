"""How often a node's agent publishes its snapshot holdings (`snapshots/<node>` in etcd).

Each publication is a put, and a watch event to every agent. The records are for operators
(`ultractl`) and metrics, and a restoring worker's first guess of where a file is: the leader
asks every member what it holds when it plans a restore, so nothing waits on them. A node
publishes at once for a new lease, job or generation (the context), else at most once a
`period`: with N live nodes each publishing at most once every N snapshot steps, the job as a
whole writes at most one holdings record per snapshot step, however many nodes it has, and
never more often than `publish_s` per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.control.records import SnapshotHoldings


@dataclass
class HoldingsPacer:
    publish_s: float
    published: tuple[int, SnapshotHoldings] | None = None  # (lease, holdings) last put
    published_at: float = 0.0  # monotonic time of the last publication
    published_for: tuple[object, ...] = ()  # the context it was for
    unpublished: bool = False  # a change came within the period: look again after it
    newest: int = -1  # the newest step held here
    newest_at: float = 0.0  # when it came
    step_interval: float = 0.0  # mean seconds between new steps (0: not known yet)

    def period(self, nodes: int) -> float:
        return max(self.publish_s, nodes * self.step_interval)

    def note_newest(self, newest: int, now: float) -> None:
        """The newest step held here is `newest` at `now`."""
        if newest > self.newest >= 0:
            gap = now - self.newest_at
            self.step_interval = gap if not self.step_interval \
                else 0.8 * self.step_interval + 0.2 * gap
        if newest != self.newest:  # newer, or a restore went back: measured from here
            self.newest, self.newest_at = newest, now

    def due_again(self, nodes: int, now: float) -> bool:
        """A change held back by the period may go now."""
        return self.unpublished and self.published_at + self.period(nodes) <= now

    def holds_back(self, context: tuple[object, ...], nodes: int, now: float) -> bool:
        """Whether a publication now waits (same context, within the period)."""
        self.unpublished = context == self.published_for and \
            now < self.published_at + self.period(nodes)
        return self.unpublished

    def sent(self, lease: int, holdings: SnapshotHoldings, context: tuple[object, ...],
             now: float) -> None:
        self.published, self.published_at, self.published_for = (lease, holdings), now, context
