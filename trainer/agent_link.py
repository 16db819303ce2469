"""The worker's side of its agent: the WorkerControl service (unix socket $ULTRA_AGENT_SOCKET)
and the step socket ($ULTRA_STEP_SOCKET).

Every call has a deadline: an agent that is stopped or hung must never hold a worker, which
would in turn hold its peers in their next collective. A call that misses its deadline, or
fails in any other way, raises AgentUnreachable; during a generation that ends the generation.

A step report does not hold the step: it is written to the step socket and the loop goes on;
its reply is read when the next step reaches its agreement (trainer.agreement), and any other
call first reads it, so the agent sees a worker's calls in the order the worker made them. The
report is not a gRPC call: one costs the worker several thread wake-ups per step (the caller's
and gRPC's event engine's), on the cores the step runs on; the step socket is one `send` and one
`recv` on the loop's own thread (trainer/step_socket.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import grpc

from checkpoint.snapshot_format import MAX_RANGES_PER_CALL
from checkpoint.snapshot_reader import Fetch, Range
from parallel.job import FaultConfig
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from trainer.agreement import Agreement
from trainer.driver import Blocked
from trainer.loop import StepResult
from trainer.restore_order import Restored
from trainer.step_socket import StepSocket
from trainer.telemetry import ExpertTelemetry

# Beyond the long poll's own wait: the agent's answer and the socket's round trip.
LONG_POLL_MARGIN_S = 5.0


class AgentUnreachable(RuntimeError):
    """A WorkerControl call failed or missed its deadline."""


def _unreachable(name: str, exc: grpc.RpcError) -> AgentUnreachable:
    code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    return AgentUnreachable(f"agent unreachable: {name} failed ({code})")


def _step_unreachable(exc: OSError) -> AgentUnreachable:
    code = "DEADLINE_EXCEEDED" if isinstance(exc, TimeoutError) else "UNAVAILABLE"
    return AgentUnreachable(f"agent unreachable: ReportStep failed ({code}: {exc})")


def rpc_timeout(fault: FaultConfig) -> float:
    """Deadline of one worker-to-agent call, in seconds.

    The agent stops trusting a worker silent for heartbeat_timeout_s; the worker trusts its
    agent as long. Capped at half the hang floor: a worker stuck on its agent holds its peers in
    the next collective, and it should leave the world (failing their collective at once, as a
    peer failure) well before their agents' watchdogs call those healthy ranks hung.
    """
    return min(fault.heartbeat_timeout_s, fault.hang_floor_s / 2)


class AgentLink:
    """Typed, deadline-bound WorkerControl calls for one local rank."""

    def __init__(self, socket_path: str, local_rank: int, fault: FaultConfig | None = None,
                 step_socket: str = "") -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket_path}")
        self.stub = pb_grpc.WorkerControlStub(self.channel)
        self.local_rank = local_rank
        self._steps = StepSocket(step_socket)
        # When the reply to the step report in flight is due (time.monotonic()); None: none is
        # in flight. The deadline runs from the report's sending, as a call's would.
        self._reply_due: float | None = None
        self._restore_call: grpc.Future | None = None  # the restore report, until answered
        self.use(fault or FaultConfig())  # before the first plan the job's are unknown

    def use(self, fault: FaultConfig) -> None:
        """Adopt the deadlines of the job of the generation being joined."""
        self.fault = fault
        self.timeout_s = rpc_timeout(fault)

    def close(self) -> None:
        self._restore_sent()
        self._steps.close()
        self.channel.close()

    def _call(self, name: str, request, timeout: float | None = None, settle: bool = True):
        """`settle`: first wait for the step report in flight (not from the heartbeat's thread:
        only the loop's thread sends step reports and settles them)."""
        if settle:
            self._restore_sent()
            self.settle()
        try:
            return getattr(self.stub, name)(request, timeout=timeout or self.timeout_s)
        except grpc.RpcError as exc:
            raise _unreachable(name, exc) from None

    def settle(self) -> Agreement:
        """The requests in the reply to the step report in flight (waiting for it until its
        deadline, which runs from the report's sending); none when no report is in flight."""
        due, self._reply_due = self._reply_due, None
        if due is None:
            return Agreement()
        try:
            # At least a moment: a zero timeout would make the socket non-blocking.
            return Agreement.of(self._steps.reply(max(due - time.monotonic(), 1e-3)))
        except OSError as exc:
            raise _step_unreachable(exc) from None

    def next_generation(self, after: int, wait_s: float = 30.0) -> pb.GenerationPlan:
        """Long-poll until a generation newer than `after` (or exit) is known."""
        while True:
            reply = self._call(
                "GetGeneration",
                pb.GenerationRequest(
                    after_generation=after, local_rank=self.local_rank, wait_seconds=wait_s
                ),
                timeout=wait_s + LONG_POLL_MARGIN_S,
            )
            if reply.exit or reply.changed:
                return reply

    def heartbeat(self, generation: int, phase: str, step: int, timeout: float) -> None:
        self._call(
            "Heartbeat",
            pb.HeartbeatRequest(
                local_rank=self.local_rank, generation=generation, phase=phase, step=step
            ),
            timeout=timeout,
            settle=False,
        )

    def report_step(self, gp: pb.GenerationPlan, r: StepResult, dp: int,
                    blocked: Blocked | None = None,
                    experts: ExpertTelemetry | None = None) -> None:
        """Send step `r`'s report without waiting for the reply (`settle` reads it).
        `blocked`: what checkpoints taken since the previous report held the loop;
        `experts`: a MoE model's expert figures (trainer.telemetry.expert_telemetry)."""
        report = pb.StepReport(
            generation=gp.generation,
            global_rank=gp.global_rank,
            local_rank=self.local_rank,
            step=r.step,
            loss=r.loss,
            tokens=r.tokens,
            consumed_samples=r.consumed_samples,
            step_seconds=r.step_seconds,
            world_size=gp.world_size,
            dp=dp,
            recompute_seconds=r.recompute_seconds,
            recompute_ratio=r.recompute_ratio,
            learning_rate=r.lr,
            grad_norm=r.grad_norm,
            skipped=r.skipped,
        )
        if r.eval_loss is not None:  # steps followed by an evaluation (trainer.evaluation)
            report.eval_loss = r.eval_loss
        if r.mfu is not None:  # known device peak only (trainer.telemetry)
            report.mfu = r.mfu
        if r.bubble_ratio_measured is not None:  # pipeline parallelism only
            report.bubble_ratio = r.bubble_ratio_measured
        if r.memory is not None:
            m = r.memory
            report.memory_params_bytes = m.params
            report.memory_grads_bytes = m.grads
            report.memory_optimizer_bytes = m.optimizer
            report.memory_activations_bytes = m.activations
            if m.peak is not None:  # the CUDA allocator's peak
                report.memory_peak_bytes = m.peak
        if experts is not None:
            report.aux_loss = experts.aux_loss
            report.dropped_tokens = experts.dropped
            report.expert_load.extend(pb.ExpertLoad(layer=layer, tokens=row)
                                      for layer, row in experts.load.items())
        if blocked is not None and blocked.memory is not None:
            report.snapshot_blocking_seconds = blocked.memory
        if blocked is not None and blocked.durable is not None:
            report.checkpoint_blocking_seconds = blocked.durable
        self._restore_sent()  # the agent hears of the restore before the first step
        self.settle()  # one report in flight at most
        sent = time.monotonic()
        try:
            self._steps.send(report, self.timeout_s)
        except OSError as exc:
            raise _step_unreachable(exc) from None
        self._reply_due = sent + self.timeout_s

    def report_failure(
        self, gp: pb.GenerationPlan, message: str, kind: str, step: int, failed_at: float
    ) -> None:
        """`failed_at`: Unix time this rank saw the failure (the agent's detect phase)."""
        self._call(
            "ReportFailure",
            pb.FailureReport(
                generation=gp.generation,
                global_rank=gp.global_rank,
                local_rank=self.local_rank,
                message=message,
                kind=kind,
                step=step,
                failed_at=failed_at,
            ),
        )

    def report_checkpoint(
        self, gp: pb.GenerationPlan, step: int, path: str, seconds: float
    ) -> None:
        self._call(
            "ReportCheckpoint",
            pb.CheckpointReport(
                generation=gp.generation,
                global_rank=gp.global_rank,
                local_rank=self.local_rank,
                step=step,
                path=path,
                seconds=seconds,
            ),
        )

    def report_done(
        self, gp: pb.GenerationPlan, step: int, consumed_samples: int, *, stopped: bool
    ) -> None:
        self._call(
            "ReportDone",
            pb.DoneReport(
                generation=gp.generation,
                global_rank=gp.global_rank,
                local_rank=self.local_rank,
                step=step,
                consumed_samples=consumed_samples,
                stopped=stopped,
            ),
        )

    def snapshot_fetch(self, step: int) -> Fetch:
        """A fetch of byte ranges of snapshot `step` through the agent, from this node's memory
        or the peers': one call for up to MAX_RANGES_PER_CALL ranges (the agent makes one call
        per holding peer). A failed call raises OSError, which the snapshot reader reports as
        files it could not fetch (and the restore falls back)."""

        def fetch(ranges: Sequence[Range]) -> list[bytes]:
            out: list[bytes] = []
            for first in range(0, len(ranges), MAX_RANGES_PER_CALL):
                out += self._fetch_ranges(step, ranges[first:first + MAX_RANGES_PER_CALL])
            return out

        return fetch

    def _fetch_ranges(self, step: int, ranges: Sequence[Range]) -> list[bytes]:
        request = pb.SnapshotRanges(step=step, ranges=[
            pb.FileRange(file=r.file, offset=r.offset, length=r.length) for r in ranges])
        pieces: list[list[bytes]] = [[] for _ in ranges]
        try:
            for piece in self.stub.FetchSnapshot(request, timeout=self.fault.restore_timeout_s):
                if not 0 <= piece.range < len(pieces):
                    raise OSError(f"FetchSnapshot answered range {piece.range} of {len(pieces)}")
                pieces[piece.range].append(piece.data)
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
            details = exc.details() if hasattr(exc, "details") else ""
            files = ", ".join(sorted({r.file for r in ranges}))
            raise OSError(f"FetchSnapshot {files} failed ({code}: {details})") from None
        if not all(pieces):
            raise OSError("FetchSnapshot left ranges unanswered")
        return [b"".join(p) for p in pieces]

    def report_restore(self, gp: pb.GenerationPlan, r: Restored) -> None:
        """Best effort: what this rank restored (rank 0's report becomes an event). Sent
        without waiting: the first step starts at once, and the reply is awaited before this
        rank's next call or step report, so the agent still hears of the restore first."""
        self._restore_sent()  # one in flight at most
        self.settle()
        self._restore_call = self.stub.ReportRestore.future(
            pb.RestoreReport(
                generation=gp.generation,
                global_rank=gp.global_rank,
                local_rank=self.local_rank,
                source=r.source,
                step=r.step,
                skipped=r.skipped[:2000],
                seconds=r.seconds,
                snapshot_bytes=r.snapshot_bytes,
            ),
            timeout=self.timeout_s,
        )

    def _restore_sent(self) -> None:
        """Wait for the restore report in flight, if any (its failure is not this rank's)."""
        call, self._restore_call = self._restore_call, None
        if call is not None:
            with contextlib.suppress(grpc.RpcError):
                call.result()
