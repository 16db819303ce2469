"""The node side's decisions (daemon/node/node_decision.py), as values, without processes:
which workers to start, when the standby is kept, when a worker must exit, which hung worker
to kill and which generation its death fails, and what the job's end changes. The hang
verdicts come from the real detector (daemon/node/watchdog.py), fed heartbeats by hand."""

from __future__ import annotations

import dataclasses

import pytest

from daemon.control.records import FailureKind, JobState, Progress
from daemon.node.node_decision import (
    Hung,
    NodeActions,
    NodeFacts,
    decide_node,
    exit_failure,
    must_exit,
)
from daemon.node.watchdog import HangDetector
from parallel.job import FaultConfig, loads
from parallel.planner import NodeInfo, Plan, plan_generation
from tests.unit.test_metrics import JOB

pytestmark = pytest.mark.unit


def _plan(generation: int, nodes: tuple[str, ...] = ("a", "b"), restore_step: int = 10
          ) -> Plan:
    restore = {"source": "snapshot", "step": restore_step} if restore_step else None
    return plan_generation(loads(JOB), [NodeInfo(n, 2) for n in nodes], generation, ("h", 1),
                           restore=restore)


def _facts(**changes) -> NodeFacts:
    """Node a, 2 devices, both workers alive, training generation 3 at step 12 (restored from
    step 10), nothing broken."""
    base = NodeFacts(node="a", devices=2, plan=_plan(3), progress=Progress(generation=3, step=12),
                     job=JobState.RUNNING, draining=False, stopping=False, broken_generation=0,
                     workers=frozenset({0, 1}))
    return dataclasses.replace(base, **changes)


def test_start_gives_each_local_rank_of_the_plan_a_worker() -> None:
    # A node's first generation: no worker yet, nothing trained: start both, no standby yet.
    first = _facts(plan=_plan(1, restore_step=0), progress=Progress(), workers=frozenset())
    actions = decide_node(first)
    assert actions.start == (0, 1) and actions.standby is None and actions.kill == ()
    assert not must_exit(first, 0) and not must_exit(first, 1)
    assert must_exit(first, 2)  # not one of this node's devices
    # Once the generation trained a step past its restore point, a standby is kept.
    assert decide_node(_facts()) == NodeActions(standby=True)
    # A node the plan leaves out starts nothing and keeps no standby.
    out = _facts(plan=_plan(3, nodes=("b", "c")))
    assert decide_node(out).start == () and decide_node(out).standby is False


@pytest.mark.parametrize("standby_ready", [True, False])
def test_a_dead_worker_fails_its_generation_and_its_rank_gets_a_new_one(standby_ready) -> None:
    after = _facts(workers=frozenset({0}), standby_ready=standby_ready)
    failure = exit_failure(after, 1, returncode=-9, error="", expected=False, hung=None)
    assert failure is not None
    assert (failure.generation, failure.kind, failure.step) == (3, FailureKind.EXIT, 12)
    assert failure.message == "worker local_rank=1 exited with -9"
    actions = decide_node(after)
    # Rank 1 gets a worker at once: the waiting standby (torch already imported) when there
    # is one, else a new process.
    assert actions.start == (1,) and actions.adopt == (1 if standby_ready else None)
    # While generation 3 is broken no new standby is started: the next generation's workers
    # start and restore first.
    broken = dataclasses.replace(after, broken_generation=3, standby_ready=False,
                                 workers=frozenset({0, 1}))
    assert decide_node(broken) == NodeActions(standby=None)
    # The next generation trains past its restore point: a standby is kept once more.
    healed = dataclasses.replace(broken, plan=_plan(4), progress=Progress(generation=4, step=13))
    assert decide_node(healed) == NodeActions(standby=True)
    # An exit the agent asked for fails nothing.
    assert exit_failure(after, 1, returncode=0, error="", expected=True, hung=None) is None


def test_a_hung_worker_is_killed_and_fails_the_generation_it_hung_in() -> None:
    fault = FaultConfig()
    hangs = HangDetector()
    hangs.started(0, now=0.0)
    hangs.started(1, now=0.0)
    hangs.beat(0, 3, "step", 12, now=1.0)
    hangs.beat(1, 3, "step", 12, now=1.0)
    hangs.step_done(0, 13, 0.05, now=1.05)
    hangs.beat(0, 3, "step", 13, now=1.05 + fault.heartbeat_timeout_s)
    now = 1.05 + fault.heartbeat_timeout_s + 0.1
    found = [Hung(rank, reason, hangs.generation_of(rank))
             for rank, reason in hangs.hung(now, fault, current=3)]
    assert [h.local_rank for h in found] == [1]  # rank 1 stopped beating, rank 0 did not
    assert "heartbeat silent" in found[0].reason
    facts = _facts(hung=tuple(found))
    assert decide_node(facts).kill == tuple(found)
    # Its worker gone meanwhile: nothing left to kill (its exit is reported as an exit).
    assert decide_node(dataclasses.replace(facts, workers=frozenset({0}))).kill == ()
    failure = exit_failure(_facts(workers=frozenset({0})), 1, -9, "", expected=True,
                           hung=found[0])
    assert failure is not None and failure.kind == FailureKind.HANG
    assert (failure.generation, failure.step) == (3, 12)
    assert failure.message.startswith("worker local_rank=1 hung: heartbeat silent")


def test_a_worker_still_in_the_old_generation_is_killed_for_it_not_the_new_one() -> None:
    fault = FaultConfig()
    hangs = HangDetector()
    hangs.started(0, now=0.0)
    hangs.beat(0, 3, "step", 12, now=1.0)  # stuck in a collective of generation 3
    grace = 5.0
    assert hangs.hung(2.0, fault, current=4, obsolete_grace=grace) == []  # g4 just began
    late = 2.0 + grace + 0.1
    hangs.beat(0, 3, "step", 12, now=late)  # still beating: gloo released the interpreter
    verdicts = hangs.hung(late, fault, current=4, obsolete_grace=grace)
    assert [rank for rank, _ in verdicts] == [0]
    hung = Hung(0, verdicts[0][1], hangs.generation_of(0))
    facts = _facts(plan=_plan(4), progress=Progress(generation=3, step=12), hung=(hung,))
    assert decide_node(facts).kill == (hung,)
    failure = exit_failure(facts, 0, -9, "", expected=True, hung=hung)
    assert failure is not None and failure.generation == 3  # not 4: g4 waits for a worker
    assert failure.step == 12
    assert "still in phase step of generation 3" in failure.message


@pytest.mark.parametrize("end", [
    {"job": JobState.CANCELLED},
    {"job": JobState.FAILED},
    {"progress": Progress(generation=3, step=40, finished=True)},
])
def test_at_the_jobs_end_workers_exit_none_start_and_the_standby_goes(end) -> None:
    over = _facts(workers=frozenset({0}), **end)
    assert must_exit(over, 0) and must_exit(over, 1)
    actions = decide_node(over)
    assert actions.start == () and actions.standby is False
    assert exit_failure(over, 1, 0, "", expected=True, hung=None) is None
    # Finished in an older generation is not the end of this one.
    if "progress" in end:
        again = _facts(plan=_plan(4), progress=Progress(generation=3, step=40, finished=True))
        assert not must_exit(again, 0)


@pytest.mark.parametrize("change,standby,exits", [
    ({}, True, False),
    ({"stopping": True}, False, True),
    ({"draining": True}, False, False),  # still in the plan: trains until the plan drops it
    ({"draining": True, "plan": _plan(4, nodes=("b",))}, False, True),
    ({"broken_generation": 3}, None, False),
    ({"progress": Progress(generation=3, step=10)}, None, False),  # not past its restore yet
])
def test_the_standby_is_kept_only_while_the_node_trains_on(change, standby, exits) -> None:
    facts = _facts(**change)
    assert decide_node(facts).standby is standby
    assert must_exit(facts, 0) is exits
