"""When an agent keeps a standby worker: while its node trains in a job that goes on, and not
once the agent stops or drains (Agent._standby, on stand-in state)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from daemon.agent import Agent
from daemon.control.records import JobState, NodeState

pytestmark = pytest.mark.unit


class _Supervisor:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def keep_standby(self) -> None:
        self.calls.append("keep")

    async def drop_standby(self) -> None:
        self.calls.append("drop")


def _agent(*, stopping: bool = False, node_state: NodeState = NodeState.READY,
           state: JobState = JobState.RUNNING) -> SimpleNamespace:
    plan = SimpleNamespace(generation=3, restore=SimpleNamespace(step=10))
    view = SimpleNamespace(plan=plan, progress=SimpleNamespace(generation=3, step=12,
                                                               finished=False),
                           spec=SimpleNamespace(mod_revision=7),
                           status=SimpleNamespace(state=state, spec_revision=7, reason=""))
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
    ({"state": JobState.CANCELLED}, ["drop"]),
])
def test_a_standby_is_kept_only_while_the_node_trains_on(case, expected):
    agent = _agent(**case)
    asyncio.run(Agent._standby(agent, agent.view.plan))
    assert agent.supervisor.calls == expected
