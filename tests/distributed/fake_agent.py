"""A scripted stand-in for the agent's WorkerControl service, to test real workers against.

It hands out a fixed list of generations (one node, `world` local ranks, a TCPStore hosted by
the test), answers the step reports on its step socket (as the agent does, framed:
proto/step_frames.py) with the script's reply and records every request, the step reports as
"ReportStep". It decides nothing: the tests check what the workers did with the replies.
"""

from __future__ import annotations

import shutil
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc
import torch.distributed as dist

from parallel.job import JobConfig
from parallel.planner import NodeInfo, plan_generation
from proto.step_frames import HEADER, frame, payload_length
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests.conftest import REPO, worker_env

NODE = "node-a"
# (generation, request) -> the reply to a ReportStep
StepScript = Callable[[int, pb.StepReport], pb.StepReply]


@dataclass(frozen=True)
class Record:
    at: float  # time.monotonic() when it arrived
    request: object


class FakeAgent(pb_grpc.WorkerControlServicer):
    def __init__(self, job: JobConfig, world: int, generations: int, on_step: StepScript) -> None:
        self.job, self.world, self.generations, self.on_step = job, world, generations, on_step
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.records: dict[str, list[Record]] = {}
        self.lock = threading.Lock()
        self.release = threading.Event()  # ends any reply the script made hang
        self.socket = Path(tempfile.mkdtemp(prefix="fa-", dir="/tmp")) / "agent.sock"
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        pb_grpc.add_WorkerControlServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix:{self.socket}")
        self.step_socket = self.socket.with_name("steps.sock")
        self.steps = _StepServer(str(self.step_socket), self)

    def __enter__(self) -> FakeAgent:
        self.server.start()
        threading.Thread(target=self.steps.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.stop(grace=0)
        self.steps.shutdown()
        self.steps.server_close()
        shutil.rmtree(self.socket.parent, ignore_errors=True)

    def _record(self, name: str, request: object) -> None:
        with self.lock:
            self.records.setdefault(name, []).append(Record(time.monotonic(), request))

    def requests(self, name: str) -> list:
        with self.lock:
            return [r.request for r in self.records.get(name, [])]

    def timed(self, name: str) -> list[Record]:
        with self.lock:
            return list(self.records.get(name, []))

    def GetGeneration(self, request, context):
        self._record("GetGeneration", request)
        generation = request.after_generation + 1
        if generation > self.generations:
            return pb.GenerationPlan(generation=request.after_generation, exit=True, global_rank=-1)
        plan = plan_generation(
            self.job, [NodeInfo(NODE, self.world)], generation, ("127.0.0.1", self.store.port)
        )
        return pb.GenerationPlan(
            generation=generation,
            plan_json=plan.to_json(),
            changed=True,
            global_rank=request.local_rank,
            local_rank=request.local_rank,
            world_size=self.world,
            store_host="127.0.0.1",
            store_port=self.store.port,
            store_prefix=f"fake-run/{generation}",
        )

    def ReportStep(self, request, context):
        self._record("ReportStep", request)
        return self.on_step(request.generation, request)

    def Heartbeat(self, request, context):
        self._record("Heartbeat", request)
        return pb.HeartbeatReply()

    def ReportFailure(self, request, context):
        self._record("ReportFailure", request)
        return pb.FailureReply()

    def ReportDone(self, request, context):
        self._record("ReportDone", request)
        return pb.DoneReply()

    def ReportCheckpoint(self, request, context):
        self._record("ReportCheckpoint", request)
        return pb.CheckpointReportReply()

    def hang(self, seconds: float) -> None:
        """Make the current reply late, as a hung agent's would be."""
        self.release.wait(seconds)


class _StepServer(socketserver.ThreadingUnixStreamServer):
    """The fake agent's step socket: one thread per worker connection."""

    daemon_threads = True

    def __init__(self, path: str, agent: FakeAgent) -> None:
        self.agent = agent
        super().__init__(path, _StepConnection)


class _StepConnection(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        while True:
            header = self.rfile.read(HEADER.size)
            if len(header) < HEADER.size:
                return  # the worker closed the connection
            report = pb.StepReport.FromString(self.rfile.read(payload_length(header)))
            reply = self.server.agent.ReportStep(report, None)  # type: ignore[attr-defined]
            try:
                self.wfile.write(frame(reply.SerializeToString()))
            except OSError:
                return  # the worker gave up on this reply (its deadline) and closed


def run_workers(
    agent: FakeAgent,
    logs: Path,
    env: dict[int, dict[str, str]] | None = None,
    timeout: float = 240,
) -> list[int]:
    """Run `python -m trainer.worker` for every local rank until they exit; their exit codes."""
    procs = []
    for rank in range(agent.world):
        e = worker_env()
        e.update(
            {
                "ULTRA_AGENT_SOCKET": str(agent.socket),
                "ULTRA_STEP_SOCKET": str(agent.step_socket),
                "ULTRA_LOCAL_RANK": str(rank),
                "ULTRA_NODE_ID": NODE,
                "ULTRA_WORKER_THREADS": "1",
            }
        )
        e.pop("ULTRA_AGENT_PID", None)
        e.update((env or {}).get(rank, {}))
        log = (logs / f"worker{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "trainer.worker"],
                cwd=REPO,
                env=e,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def tail(logs: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(logs.glob("worker*.log"))
    )
