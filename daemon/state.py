"""The agent's explicit state machine; every transition is logged once, with its reason."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class AgentState(str, enum.Enum):
    JOINING = "joining"              # no live lease yet (start, or after fencing)
    WAITING = "waiting"              # a member, but not in the current generation
    RUNNING = "running"              # in the current generation, workers started
    RECONFIGURING = "reconfiguring"  # moving workers to a newer generation
    DRAINING = "draining"            # leaving at a step boundary on an admin request


# Fencing may interrupt any state; everything else follows the generation lifecycle.
_ALLOWED: dict[AgentState, frozenset[AgentState]] = {
    # After fencing, a re-joined agent may find itself in the current generation at once.
    AgentState.JOINING: frozenset({AgentState.WAITING, AgentState.DRAINING,
                                   AgentState.RECONFIGURING, AgentState.RUNNING}),
    AgentState.WAITING: frozenset({AgentState.RECONFIGURING, AgentState.RUNNING,
                                   AgentState.DRAINING, AgentState.JOINING}),
    AgentState.RUNNING: frozenset({AgentState.RECONFIGURING, AgentState.DRAINING,
                                   AgentState.WAITING, AgentState.JOINING}),
    AgentState.RECONFIGURING: frozenset({AgentState.RUNNING, AgentState.WAITING,
                                         AgentState.DRAINING, AgentState.JOINING}),
    AgentState.DRAINING: frozenset({AgentState.WAITING, AgentState.JOINING,
                                    AgentState.RECONFIGURING}),
}


class StateMachine:
    def __init__(self, on_change: Callable[[AgentState, AgentState, str], None] | None = None
                 ) -> None:
        self.state = AgentState.JOINING
        self.since = time.monotonic()
        self._listeners = [on_change] if on_change else []

    def subscribe(self, listener: Callable[[AgentState, AgentState, str], None]) -> None:
        """`listener(old, new, reason)` after each transition; it must not block."""
        self._listeners.append(listener)

    def to(self, new: AgentState, reason: str) -> bool:
        """Move to `new`; False (and nothing logged) when already there."""
        old = self.state
        if new == old:
            return False
        if new not in _ALLOWED[old]:
            # A bug, not a user error: keep running, but make it loud.
            log.error("unexpected agent transition %s -> %s (%s)", old.value, new.value, reason)
        log.info("agent %s -> %s: %s", old.value, new.value, reason)
        self.state, self.since = new, time.monotonic()
        for listener in self._listeners:
            listener(old, new, reason)
        return True
