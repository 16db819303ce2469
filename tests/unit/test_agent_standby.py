"""When an agent keeps a standby worker: while its node trains in a job that goes on, and not
once the agent stops or drains (Agent._standby, on stand-in state); and what a worker's exit
means (Agent._on_worker_exit)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from daemon.agent import Agent
from daemon.control.records import JobState, NodeState
from daemon.node.supervisor import EXIT_REPLACE_ME, WorkerExit

pytestmark = pytest.mark.unit


class _Supervisor:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def keep_standby(self) -> None:
        self.calls.append("keep")

    async def drop_standby(self) -> None:
        self.calls.append("drop")


def _agent(*, stopping: bool = False, node_state: NodeState = NodeState.READY) -> SimpleNamespace:
    plan = SimpleNamespace(generation=3, restore=SimpleNamespace(step=10))
    view = SimpleNamespace(plan=plan, progress=SimpleNamespace(generation=3, step=12,
                                                               finished=False),
                           status=SimpleNamespace(state=JobState.RUNNING))
    agent = SimpleNamespace(supervisor=_Supervisor(), view=view, broken_generation=0,
                            membership=SimpleNamespace(record=SimpleNamespace(state=node_state)),
                            stopping=asyncio.Event())
    if stopping:
        agent.stopping.set()
    agent._job_over = lambda: Agent._job_over(agent)
    return agent


@pytest.mark.parametrize("case,expected", [
    ({}, ["keep"]),
    ({"stopping": True}, ["drop"]),
    ({"node_state": NodeState.DRAINING}, ["drop"]),
])
def test_a_standby_is_kept_only_while_the_node_trains_on(case, expected):
    agent = _agent(**case)
    asyncio.run(Agent._standby(agent, agent.view.plan))
    assert agent.supervisor.calls == expected


def _exit_agent() -> SimpleNamespace:
    """Stand-in state for Agent._on_worker_exit: node n1 in the running plan."""
    plan = SimpleNamespace(nodes=("n1", "n2"))
    agent = SimpleNamespace(node_id="n1", supervisor=object(), _hung={}, failures=[], spawned=[],
                            hangs=SimpleNamespace(forget=lambda rank: None),
                            view=SimpleNamespace(generation=4, plan=plan,
                                                 progress=SimpleNamespace(generation=4, step=9)))
    agent.on_worker_failure = lambda *args: agent.failures.append(args)
    agent.tasks = SimpleNamespace(spawn=lambda coro, name, long_lived: (
        coro.close(), agent.spawned.append(name)))
    agent._ensure_workers = lambda plan: asyncio.sleep(0)
    agent._replace_worker = lambda rank: Agent._replace_worker(agent, rank)
    return agent


@pytest.mark.parametrize("code,expected,failed,replaced", [
    (EXIT_REPLACE_ME, True, False, True),  # left a world it could not free: not a failure
    (0, True, False, False),  # done with the job
    (3, False, True, True),  # a crash
])
def test_a_worker_that_asks_to_be_replaced_is_not_a_failure(code, expected, failed, replaced,
                                                            tmp_path):
    agent = _exit_agent()
    Agent._on_worker_exit(agent, WorkerExit(0, 123, code, expected, tmp_path / "log"))
    assert bool(agent.failures) == failed
    assert agent.spawned == (["respawn-0"] if replaced else [])
