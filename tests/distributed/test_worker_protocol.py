"""Real `python -m trainer.worker` processes (3 gloo ranks) against a scripted WorkerControl.

Ranks see each request in the reply to a different step (rank 2 first, then rank 1, then rank
0, one step apart); every rank must act on it together, at the step after the first of those
(the reply is agreed inside the next step: the step never waits for it). Failures are
reported with their kind, and a worker whose agent stops answering leaves the world so that
its peers fail at once instead of at the process-group timeout.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from parallel.job import load, process_group_timeout
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import small_job_text
from tests.distributed.fake_agent import FakeAgent, run_workers, tail

pytestmark = pytest.mark.distributed
WORLD = 3
BATCH = 10  # small_job_text's global batch


def _job(tmp_path: Path, token_file: Path, steps: int, **sections: dict):
    path = tmp_path / "job.toml"
    path.write_text(
        small_job_text(
            token_file,
            train={"steps": steps},
            job={"output_dir": str(tmp_path / "out")},
            checkpoint={"dir": "ckpt", "keep": 8},
            **sections,
        )
    )
    return load(path)


def _seen(step: int, first: int, rank: int) -> bool:
    """Rank 2 sees a request at step `first`, rank 1 a step later, rank 0 two steps later."""
    return step >= first + (WORLD - 1 - rank)


def _by_generation(requests: list, generation: int) -> list:
    return [r for r in requests if r.generation == generation]


def _checkpoints(tmp_path: Path) -> list[int]:
    root = tmp_path / "out" / "ckpt"  # relative checkpoint.dir lives under job.output_dir
    return sorted(
        int(p.name.split("_")[1]) for p in root.glob("step_*") if (p / "manifest.json").exists()
    )


def test_requests_take_effect_at_the_step_after_the_first_reply_any_rank_saw_them(
        tmp_path, token_file):
    """Generation 1: a checkpoint request first in the reply to step 2 (taken at step 3), a stop
    first in the reply to step 4 (taken at step 5). Generation 2 restores step 5; its checkpoint
    requests (counted from 0 again) are first in the replies to steps 6 and 8 (taken at 7 and
    9), and it runs to the job's end (10)."""

    def script(generation: int, r: pb.StepReport) -> pb.StepReply:
        rank = r.global_rank
        if generation == 1:
            return pb.StepReply(
                stop=_seen(r.step, 4, rank), checkpoint_seq=int(_seen(r.step, 2, rank))
            )
        seq = int(_seen(r.step, 6, rank)) + int(_seen(r.step, 8, rank))
        return pb.StepReply(checkpoint_seq=seq)

    job = _job(tmp_path, token_file, 10)
    with FakeAgent(job, WORLD, generations=2, on_step=script) as agent:
        codes = run_workers(agent, tmp_path)
    assert codes == [0] * WORLD, tail(tmp_path)
    assert agent.requests("ReportFailure") == [], tail(tmp_path)

    steps = agent.requests("ReportStep")
    assert sorted({r.step for r in _by_generation(steps, 1)}) == [1, 2, 3, 4, 5]
    assert sorted({r.step for r in _by_generation(steps, 2)}) == [6, 7, 8, 9, 10]
    assert len(steps) == WORLD * 10

    done = agent.requests("ReportDone")
    assert sorted(
        (d.generation, d.global_rank, d.step, d.consumed_samples, d.stopped) for d in done
    ) == [(1, rank, 5, 5 * BATCH, True) for rank in range(WORLD)] + [
        (2, rank, 10, 10 * BATCH, False) for rank in range(WORLD)
    ]
    # Each rank's calls reach the agent in the order it made them: its last step's report
    # (sent without waiting) before its ReportDone.
    arrived = {(name, r.request.generation, r.request.global_rank, r.request.step): r.at
               for name in ("ReportStep", "ReportDone") for r in agent.timed(name)}
    for rank in range(WORLD):
        for generation, last in ((1, 5), (2, 10)):
            assert arrived[("ReportStep", generation, rank, last)] \
                < arrived[("ReportDone", generation, rank, last)]

    reported = [(c.generation, c.global_rank, c.step) for c in agent.requests("ReportCheckpoint")]
    assert reported == [(1, 0, 3), (1, 0, 5), (2, 0, 7), (2, 0, 9), (2, 0, 10)]
    for c in agent.requests("ReportCheckpoint"):
        assert c.path == str(tmp_path / "out" / "ckpt" / f"step_{c.step:08d}")
        assert c.HasField("seconds") and c.seconds > 0  # exported as a checkpoint duration
    assert _checkpoints(tmp_path) == [3, 5, 7, 9, 10]
    # A checkpoint's staging blocked the loop: reported with the next step (the stop's at step 5
    # and the last one at step 10 have none). No snapshot root is set: no snapshot blocked it.
    for rank in range(WORLD):
        mine = [r for r in steps if r.global_rank == rank]
        assert sorted(r.step for r in mine if r.HasField("checkpoint_blocking_seconds")) \
            == [4, 8, 10]
        assert all(r.checkpoint_blocking_seconds > 0 for r in mine
                   if r.HasField("checkpoint_blocking_seconds"))
        assert not any(r.HasField("snapshot_blocking_seconds") for r in mine)

    lines = (tmp_path / "out" / "steps.jsonl").read_text().splitlines()
    assert len(lines) == 10  # one per step: generation 2 continued from the stop checkpoint

    beats = agent.requests("Heartbeat")
    # A phase is sent as soon as it starts; join can be over before the thread runs, though.
    assert "join" in {b.phase for b in beats}
    for rank in range(WORLD):
        beats = [b for b in agent.requests("Heartbeat") if b.local_rank == rank]
        phases = {b.phase for b in beats}
        assert {"idle", "restore", "step", "checkpoint"} <= phases, phases
        assert all(b.generation == 0 for b in beats if b.phase == "idle")
        assert max(b.step for b in beats if b.generation == 2) == 10


def test_failures_are_reported_with_their_kind_and_never_wait_on_the_agent(tmp_path, token_file):
    """Rank 1 fails at step 2 (injected) in generations 1 and 2: a local failure there, a peer
    failure on the others. In generation 3 rank 1's agent hangs on its first ReportStep: rank 1
    gives up after its 2 s deadline and leaves, and its peers fail at once (peer, all)."""
    job = _job(tmp_path, token_file, 4, fault={"heartbeat_timeout_s": 2.0, "join_timeout_s": 100.0})
    assert process_group_timeout(job.fault) >= 100

    agent: FakeAgent

    def script(generation: int, r: pb.StepReport) -> pb.StepReply:
        if generation == 3 and r.global_rank == 1:
            agent.hang(60)
        return pb.StepReply()

    env = {
        1: {
            "ULTRA_NODE_ID": "node-b",
            "ULTRA_FAULT_FAIL_AT_STEP": "2",
            "ULTRA_FAULT_FAIL_NODES": "node-b",
        }
    }
    with FakeAgent(job, WORLD, generations=3, on_step=script) as agent:
        codes = run_workers(agent, tmp_path, env)
        failures = agent.timed("ReportFailure")
        steps = agent.timed("ReportStep")
    assert codes == [0] * WORLD, tail(tmp_path)

    got = sorted(
        (f.request.generation, f.request.global_rank, f.request.kind, f.request.step)
        for f in failures
    )
    assert got == [
        (1, 0, "peer", 2),
        (1, 1, "local", 2),
        (1, 2, "peer", 2),
        (2, 0, "peer", 2),
        (2, 1, "local", 2),
        (2, 2, "peer", 2),
        (3, 0, "peer", 1),
        (3, 1, "peer", 1),
        (3, 2, "peer", 1),
    ], tail(tmp_path)
    by_key = {(f.request.generation, f.request.global_rank): f for f in failures}
    # When each rank saw its failure: the agent's detect phase of a recovery.
    assert all(f.request.HasField("failed_at") and f.request.failed_at > 0 for f in failures)
    assert by_key[(1, 1)].request.message == "RuntimeError: injected fault at step 2"
    assert "agent unreachable: ReportStep" in by_key[(3, 1)].request.message
    assert "by peer" in by_key[(3, 0)].request.message  # gloo: connection closed or reset
    assert agent.requests("ReportDone") == []

    # Generation 3: from rank 1's unanswered report to every failure report, about the 2 s
    # deadline: nobody waited for the hung agent (60 s) or the process-group timeout (100 s).
    asked = next(s.at for s in steps if s.request.generation == 3 and s.request.global_rank == 1)
    for rank in range(WORLD):
        waited = by_key[(3, rank)].at - asked
        assert 1.5 <= waited <= 30, (rank, waited)


def test_a_snapshot_every_step_stays_in_the_step_phase_after_the_first(tmp_path, token_file):
    """Each phase change is a heartbeat sent at once. A generation's first snapshot (a full DCP
    save) takes the checkpoint phase; every later one is a rewrite within the step's deadline,
    so the only other checkpoint-phase beats are the final checkpoint's."""
    steps = 10
    job = _job(tmp_path, token_file, steps)
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-test-"))
    try:
        with FakeAgent(job, WORLD, generations=1, on_step=lambda g, r: pb.StepReply()) as agent:
            codes = run_workers(agent, tmp_path,
                                env={r: {"ULTRA_SNAPSHOT_ROOT": str(shm)} for r in range(WORLD)})
        assert codes == [0] * WORLD, tail(tmp_path)
        snapped = {(r.global_rank, r.step) for r in agent.requests("ReportStep")
                   if r.HasField("snapshot_blocking_seconds")}
        # Each of steps 1..steps-1 was snapshotted (not the last): a rewrite (steps 2..) is
        # reported with its own step, the generation's first (a full save, taken after its
        # step's report) with the next, step 2.
        assert snapped == {(rank, s) for rank in range(WORLD) for s in range(2, steps)}
        for rank in range(WORLD):
            beats = [b for b in agent.requests("Heartbeat") if b.local_rank == rank]
            assert {b.step for b in beats if b.phase == "checkpoint"} <= {1, steps}, beats
    finally:
        shutil.rmtree(shm, ignore_errors=True)
