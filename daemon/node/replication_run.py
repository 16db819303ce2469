"""How far this node's part of the running generation's snapshots is replicated.

A snapshot step is complete once every shard and the manifest are held by two nodes. Each node
publishes its holdings at most once a period (holdings_pacer.py), on its own clock, and holds
only its newest two or three steps: when steps are short, two nodes' published lists need not
overlap at all, and intersecting them would call a healthy job's snapshots incomplete. So each node also
publishes a **run** `[since, through]` of snapshot steps of the running generation: every step
in it that reached this node had this node's part replicated (its own ranks' shards acknowledged
by its buddy; on the node that writes the manifest, the manifest by every live member). A run
grows as steps replicate and restarts after a step that was freed, or is still held, without its
part replicated (a gap), so a publication that lags stays true of the steps it names: the newest
step inside every member's run is complete (daemon/control/snapshot_steps.py::newest_complete).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NO_RUN = (-1, -1)


@dataclass
class ReplicationRun:
    generation: int = -1
    after: int = -1   # the step the generation restored: older steps belong to earlier ones
    limit: int = 64   # steps remembered; a run longer than that starts at the oldest of them
    _steps: dict[int, bool] = field(default_factory=dict)  # step -> this node's part replicated

    def follow(self, generation: int, after: int) -> None:
        """Start over for a new generation, which restored step `after`."""
        if generation != self.generation:
            self.generation, self.after, self._steps = generation, after, {}

    def saw(self, step: int, replicated: bool) -> None:
        """This node holds `step` (some file of it) and its part is (not yet) replicated."""
        if step <= self.after or self._steps.get(step):
            return  # an earlier generation's, or known replicated (it may be freed since)
        self._steps[step] = replicated
        for old in sorted(self._steps)[:-self.limit]:
            del self._steps[old]

    def span(self) -> tuple[int, int]:
        """(since, through): the newest replicated step and the oldest one of its unbroken run;
        NO_RUN while none is replicated."""
        replicated = [s for s, ok in self._steps.items() if ok]
        if not replicated:
            return NO_RUN
        through = since = max(replicated)
        for step in sorted((s for s in self._steps if s < through), reverse=True):
            if not self._steps[step]:
                break
            since = step
        return since, through
