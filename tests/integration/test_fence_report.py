"""How the leader learns that a member is gone: fenced members report it, leaving ones say it.

A starved agent (its keepalive acknowledgements late, its lease still alive in etcd) fences
itself and re-joins; if that happens within the leader's debounce, its node key only blinks and
the leader would keep a generation that this node no longer runs, leaving the others to wait
out `fault.join_timeout_s`. Two real agents in this process on a real etcd (control plane only);
the member that is not the leader goes through the agent's fencing callback while its key stays
put: the leader must replace the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from daemon.agent import Agent
from daemon.config import AgentConfig
from daemon.control.etcd_server import EtcdServer
from daemon.control.records import JobSpec
from parallel import job as jobmod
from tests.integration.conftest import TINY_JOB

pytestmark = pytest.mark.integration
DEADLINE_S = 60.0  # a bound for a hang, not a performance expectation


async def _until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _two_agents_running_a_job(etcd: EtcdServer, tmp_path: Path,
                                    job: str) -> AsyncIterator[list[Agent]]:
    """Agents a and b (control plane only) with a generation of both nodes; stopped after."""
    token = tmp_path / "token"
    token.write_text("t\n")
    token.chmod(0o600)
    agents = [Agent(AgentConfig(node_id=n, devices=1, etcd=etcd.endpoint,
                                state_dir=tmp_path / n, job=job, ttl=2,
                                token_file=token, workers=False)) for n in ("a", "b")]
    try:
        for agent in agents:
            await agent.start()
        a = agents[0]
        await _until(lambda: len(a.view.nodes) == 2 and a.view.leader is not None,
                     "two members and a leader")
        spec = JobSpec(config=jobmod.loads(TINY_JOB).to_dict(), toml=TINY_JOB)
        await a.etcd.put(a.keys.spec, spec.to_json())
        await _until(lambda: a.view.plan is not None and len(a.view.plan.nodes) == 2,
                     "a generation of both nodes")
        yield agents
    finally:
        for agent in agents:
            await agent.stop()


def test_a_fenced_member_gets_its_generation_replaced(etcd: EtcdServer, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with _two_agents_running_a_job(etcd, tmp_path, "fence") as agents:
            a = agents[0]
            assert a.view.plan is not None
            first = a.view.plan.generation
            leader = a.view.leader[0] if a.view.leader else ""
            member = next(x for x in agents if x.node_id != leader)
            await member._on_fenced("keepalive acknowledgements late (test)")
            await _until(lambda: a.view.generation > first, "the generation to be replaced")
            assert a.view.plan is not None and a.view.plan.generation == first + 1

    asyncio.run(scenario())


def test_a_leader_missing_its_own_node_key_keeps_yielding(etcd: EtcdServer,
                                                          tmp_path: Path) -> None:
    """The leader's own node key gone from the view (watch lag, or its lease going as it stops)
    made decide() ask for a probe of the leader itself, which it skipped, so the same decision
    came back at once: a loop that never suspended, starving the agent and ignoring
    cancellation (a hung `agent.stop()`). The scenario runs in its own thread, so that a loop
    that never yields fails this test instead of hanging the suite."""
    outcome: list[BaseException | None] = []

    async def scenario() -> None:
        async with _two_agents_running_a_job(etcd, tmp_path, "self") as agents:
            a = agents[0]
            name = a.view.leader[0] if a.view.leader else ""
            leader = next(x for x in agents if x.node_id == name)
            assert leader.leader is not None
            await leader.etcd.delete(leader.keys.node(name))
            await _until(lambda: name in leader.leader._probes, "the leader to answer for itself")
            # Other tasks still run: this sleep returns only if the leader's loop yields.
            await asyncio.sleep(0.5)

    def run() -> None:
        try:
            asyncio.run(scenario())
            outcome.append(None)
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=3 * DEADLINE_S)
    assert not thread.is_alive(), "the scenario never finished: an event loop stopped yielding"
    if outcome[0] is not None:
        raise outcome[0]


def test_a_member_leaving_cleanly_answers_probes_as_gone(etcd: EtcdServer,
                                                          tmp_path: Path) -> None:
    """A member whose key vanished but which still answers probes is, to the leader,
    re-attaching after an etcd outage: it gets two TTLs before its generation is replaced. A
    member that stops revokes its lease and its servers stop a moment later; a probe that
    reached it in between (a loaded machine stretches that moment) answered "alive", and the
    survivor waited those two TTLs for a node that was gone. So an agent on its way out answers
    its peers' probes NOT_SERVING before it revokes its lease: the leader's own probe, run
    as the lease goes, must already say it is gone."""
    async def scenario() -> None:
        async with _two_agents_running_a_job(etcd, tmp_path, "leave") as agents:
            name = agents[0].view.leader[0] if agents[0].view.leader else ""
            leader = next(x for x in agents if x.node_id == name)
            member = next(x for x in agents if x.node_id != name)
            assert member.membership is not None
            address = member.io.address
            assert await leader.io.probe(address), "a running member answers its probe"
            answers: list[bool] = []
            revoke = member.membership.leave

            async def leave() -> None:
                answers.append(await leader.io.probe(address))  # what the leader would see
                await revoke()

            member.membership.leave = leave  # type: ignore[method-assign]
            await member.stop()
            assert answers == [False], "a leaving member answered its peer's probe as alive"

    asyncio.run(scenario())
