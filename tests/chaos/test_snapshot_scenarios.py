"""Chaos scenarios of the in-memory snapshot tier (docs/snapshots.md): restores from peer
memory, repeated failures, and a fallback to the durable checkpoint when the copies died too.

Each ends with the shared checks of `ChaosRun.finish_and_check()` (every step committed once,
consumed_samples exact, committed losses equal to a torchrun replay of the same layout history,
each generation resumed from the step it restored, within 1e-6 relative), plus the tier each
restore came from, as `ultractl events` tells it.
"""

from __future__ import annotations

import re

import pytest

from tests.chaos.runner import ChaosRun

pytestmark = pytest.mark.chaos

TRIGGER = 10  # two steps past the step-8 durable checkpoint (every 4)
# The step in flight is not committed; a kill while the newest snapshot is still on its way to
# the buddy costs that step too.
MAX_RERUN = 1


def restores(run: ChaosRun) -> list[str]:
    out = run.ctl("events").stdout
    return [line for line in out.splitlines() if "restored" in line]


def memory_restores(run: ChaosRun, count: int) -> list[str]:
    problems = []
    from_memory = [line for line in restores(run) if re.search(r"restored snapshot@\d+", line)]
    if len(from_memory) < count:
        problems.append(f"expected {count} restore(s) from memory, events say: {restores(run)}")
    for i, rerun in enumerate(run.outcome.reruns):
        if rerun is not None and rerun > MAX_RERUN:
            problems.append(f"fault {i + 1} re-ran {rerun} committed steps (at most {MAX_RERUN})")
    return problems


def test_kill_agent_restores_from_peer_memory(chaos) -> None:
    run = chaos()
    run.submit()
    run.wait_step(TRIGGER)
    victim = run.non_leaders()[-1]
    with run.fault(f"SIGKILL agent {victim}: restore from memory"):
        run.kill_agent(victim)
    run.finish_and_check(extra_checks=lambda r: memory_restores(r, 1))


def test_two_failures_in_a_row_restore_from_memory(chaos) -> None:
    run = chaos(nodes=4)
    run.submit()
    run.wait_step(TRIGGER)
    first = run.non_leaders()[-1]
    with run.fault(f"SIGKILL agent {first}"):
        run.kill_agent(first)
    run.wait_step(TRIGGER + 4)
    second = run.non_leaders()[-1]
    with run.fault(f"SIGKILL agent {second}, 4 steps later"):
        run.kill_agent(second)
    run.finish_and_check(extra_checks=lambda r: memory_restores(r, 2))


def test_buddy_dies_with_the_node_falls_back_to_the_durable_checkpoint(chaos) -> None:
    """Both non-leaders of three die at once: one of them held the other's only copy, so no
    step can be assembled from memory and the restore comes from disk, saying so."""
    run = chaos()
    run.submit()
    run.wait_step(TRIGGER)
    victims = run.non_leaders()
    with run.fault(f"SIGKILL agents {', '.join(victims)} at once"):
        for node in victims:
            run.cluster.agents[node].kill()
        for node in victims:
            run.cluster.agents[node].wait()

    def from_disk(r: ChaosRun) -> list[str]:
        lines = restores(r)
        after = [line for line in lines if "restored checkpoint@" in line]
        reason = [line for line in r.ctl("events").stdout.splitlines()
                  if "no snapshot" in line]
        return [] if after and reason else [f"expected a restore from the durable checkpoint "
                                            f"with the reason, events say: {lines}"]

    run.finish_and_check(extra_checks=from_disk)
