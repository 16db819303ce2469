"""The step socket: the agent's asyncio end (daemon/node/step_socket.py) against the worker's
blocking end (trainer/step_socket.py) and AgentLink, on real unix sockets; the framing
(proto/step_frames.py); a connection that sends no step report; a silent agent."""

from __future__ import annotations

import asyncio
import logging
import socket
import stat
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from daemon.node.step_socket import serve_step_socket
from parallel.job import FaultConfig
from proto.step_frames import HEADER, MAX_FRAME_BYTES, FrameError, frame, payload_length
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from trainer.agent_link import AgentLink, AgentUnreachable
from trainer.loop import StepResult
from trainer.restore_order import Restored
from trainer.step_socket import StepSocket

pytestmark = pytest.mark.unit


class Agent:
    """The agent's end on an event loop of its own thread; answers with checkpoint_seq = step
    (and an empty reply, every field at its default, for step 0)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reports: list[pb.StepReport] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def answer(self, report: pb.StepReport) -> pb.StepReply:
        self.reports.append(report)
        return pb.StepReply(checkpoint_seq=report.step)

    def __enter__(self) -> Agent:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            serve_step_socket(self.path, self.answer), self.loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _close(self) -> None:
        self.server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:  # the connections' handlers
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with Agent(tmp_path / "steps.sock") as a:
        yield a


def test_a_frame_is_its_length_then_its_bytes_and_an_oversized_one_is_refused() -> None:
    framed = frame(b"abc")
    assert framed == b"\x00\x00\x00\x03abc"
    assert payload_length(framed[:HEADER.size]) == 3
    with pytest.raises(FrameError, match="at most"):
        payload_length(HEADER.pack(MAX_FRAME_BYTES + 1))
    with pytest.raises(FrameError, match="at most"):
        frame(bytes(MAX_FRAME_BYTES + 1))


def test_reports_are_answered_in_order_on_one_connection(agent: Agent) -> None:
    assert stat.S_IMODE(agent.path.stat().st_mode) == 0o600
    steps = StepSocket(str(agent.path))
    for step in (0, 1, 2, 3):  # step 0's reply is empty: a frame of 0 bytes
        steps.send(pb.StepReport(generation=1, step=step, loss=0.5), timeout=5)
        assert steps.reply(timeout=5).checkpoint_seq == step
    assert [r.step for r in agent.reports] == [0, 1, 2, 3]
    steps.close()


def _until_closed(sock: socket.socket) -> bytes:
    """What the other end sent before it closed the connection (a timeout: it did not)."""
    sock.settimeout(5)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


@pytest.mark.parametrize("sent, why", [
    (HEADER.pack(MAX_FRAME_BYTES + 1), "at most"),  # refused before reading or allocating
    (frame(b"\xff\xff\xff"), "Error parsing message"),  # not a StepReport
])
def test_a_connection_that_sends_no_step_report_is_closed_and_the_others_go_on(
        agent: Agent, sent: bytes, why: str, caplog: pytest.LogCaptureFixture) -> None:
    hostile = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hostile.connect(str(agent.path))
    with caplog.at_level(logging.WARNING, logger="daemon.node.step_socket"):
        hostile.sendall(sent)
        assert _until_closed(hostile) == b""  # closed by the agent, with no reply
    hostile.close()
    assert any(why in r.getMessage() and "no step report" in r.getMessage()
               for r in caplog.records)
    assert agent.reports == []
    steps = StepSocket(str(agent.path))
    steps.send(pb.StepReport(step=7), timeout=5)
    assert steps.reply(timeout=5).checkpoint_seq == 7


def test_a_silent_agent_misses_the_deadline_and_the_connection_is_not_reused(
        tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    steps = StepSocket(str(path))
    steps.send(pb.StepReport(step=1), timeout=5)
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        steps.reply(timeout=0.3)
    assert 0.25 < time.monotonic() - began < 3
    first, _ = listener.accept()
    # Closed by the worker: a reply arriving late can never answer a later report.
    sent = _until_closed(first)
    assert pb.StepReport.FromString(sent[HEADER.size:]).step == 1
    steps.send(pb.StepReport(step=2), timeout=5)  # connects again
    second, _ = listener.accept()
    assert payload_length(second.recv(HEADER.size)) > 0
    for s in (first, second, listener):
        s.close()


def _result(step: int) -> StepResult:
    return StepResult(step=step, loss=1.0, tokens=10, consumed_samples=step * 10,
                      step_seconds=0.1, grad_norm=1.0)


def test_agent_link_reads_the_reply_at_the_next_settle(agent: Agent) -> None:
    gp = pb.GenerationPlan(generation=3, global_rank=0, world_size=1)
    link = AgentLink("/nonexistent/agent.sock", 0, FaultConfig(), step_socket=str(agent.path))
    link.report_step(gp, _result(5), dp=1)
    link.report_step(gp, _result(6), dp=1)  # settles the report of step 5 first
    assert link.settle().checkpoint_seq == 6
    assert link.settle().checkpoint_seq == 0  # none in flight
    assert [(r.generation, r.step) for r in agent.reports] == [(3, 5), (3, 6)]
    link.close()


def test_agent_link_without_a_step_socket_says_which_variable_is_missing() -> None:
    link = AgentLink("/nonexistent/agent.sock", 0, FaultConfig(), step_socket="")
    with pytest.raises(AgentUnreachable, match="ReportStep failed .*ULTRA_STEP_SOCKET"):
        link.report_step(pb.GenerationPlan(generation=1), _result(1), dp=1)
    link.close()


def test_the_reply_deadline_runs_from_the_reports_sending(tmp_path: Path) -> None:
    """As a call's deadline would: a step that took longer than the deadline finds the reply
    of a silent agent overdue at once, not a whole deadline later."""
    path = tmp_path / "silent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    link = AgentLink("/nonexistent/agent.sock", 0, FaultConfig(heartbeat_timeout_s=0.6),
                     step_socket=str(path))
    link.report_step(pb.GenerationPlan(generation=1), _result(1), dp=1)
    time.sleep(0.7)  # the next step, longer than the deadline
    began = time.monotonic()
    with pytest.raises(AgentUnreachable, match="DEADLINE_EXCEEDED"):
        link.settle()
    assert time.monotonic() - began < 0.3
    link.close()
    listener.close()


class SlowRestoreAgent(pb_grpc.WorkerControlServicer):
    """WorkerControl with only ReportRestore, answered `delay` seconds after it arrives; each
    answer notes how many step reports the step socket's agent had by then."""

    def __init__(self, delay: float, steps: Agent) -> None:
        self.delay, self.steps = delay, steps
        self.answered: list[tuple[int, int]] = []  # (generation, step reports by then)

    def ReportRestore(self, request: pb.RestoreReport, context: object) -> pb.RestoreReply:
        time.sleep(self.delay)
        self.answered.append((request.generation, len(self.steps.reports)))
        return pb.RestoreReply()


def test_the_restore_report_does_not_hold_the_first_step_but_reaches_the_agent_before_its_report(
        agent: Agent, tmp_path: Path) -> None:
    servicer = SlowRestoreAgent(0.5, agent)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_WorkerControlServicer_to_server(servicer, server)
    socket_path = tmp_path / "agent.sock"
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    link = AgentLink(str(socket_path), 0, FaultConfig(), step_socket=str(agent.path))
    gp = pb.GenerationPlan(generation=4, global_rank=0, world_size=1)
    began = time.monotonic()
    link.report_restore(gp, Restored("snapshot", 5, name="snapshot@5"))
    assert time.monotonic() - began < 0.25  # the first step starts now, not after the reply
    link.report_step(gp, _result(6), dp=1)  # waits for the restore's reply first
    assert link.settle().checkpoint_seq == 6
    assert servicer.answered == [(4, 0)]  # answered before any step report arrived
    assert [r.step for r in agent.reports] == [6]
    link.close()
    server.stop(None)
