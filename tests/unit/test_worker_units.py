"""The worker's pure pieces: failure kinds, agreement decisions, deadlines, fault injection,
the heartbeat thread and where a job's checkpoints live."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from parallel.job import FaultConfig, loads
from parallel.planner import NodeInfo, plan_generation
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.unit.test_metrics import JOB
from trainer.agent_link import rpc_timeout
from trainer.agreement import Action, Agreement, decide
from trainer.driver import checkpoint_root
from trainer.failure_kind import classify_failure
from trainer.fault_injection import FaultInjection
from trainer.heartbeat import Heartbeat
from trainer.worker import next_backoff
from trainer.world import GenerationSpec, WorkerEnv

pytestmark = pytest.mark.unit

# Messages as torch 2.13 + gloo print them on this machine (a peer that exited or destroyed its
# group mid-collective, a peer that never came, a rendezvous nobody answered), and as
# ProcessGroupNCCL words them.
PEER_ERRORS = [
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:53400. This is typically caused by a remote worker "
    "crashing. Check the logs of the remote worker before reporting an error. GLHF!",
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78]"
    " Timed out waiting 2000ms for recv operation to complete",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
    "[127.0.0.1]:39186: Connection reset by peer",
    "DistNetworkError: The client socket has timed out after 1000ms while trying to connect to "
    "(127.0.0.1, 52761).",
    "DistStoreError: wait timeout after 1000ms, keys: /generation/3/0//cpu//0/1",
    "DistBackendError: NCCL communicator was aborted on rank 3.",
    "DistBackendError: [Rank 1] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=12, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.",
    "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there "
    "was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a "
    "network error or a remote process exiting prematurely.",
    "AgentUnreachable: agent unreachable: ReportStep failed (DEADLINE_EXCEEDED)",
]

LOCAL_ERRORS = [
    "RuntimeError: injected fault at step 3",
    "FileNotFoundError: [Errno 2] No such file or directory: '/data/walk.bin'",
    "RuntimeError: step 4 consumed 310 target tokens, expected 320",
    "ZeroDivisionError: division by zero",
    "PlanError: malformed plan: not JSON: Expecting value: line 1 column 1 (char 0)",
    "RuntimeError: checkpoint step_00000006 failed: [Errno 13] Permission denied",
]


@pytest.mark.parametrize("text", PEER_ERRORS)
def test_failed_collectives_and_rendezvous_are_peer_failures(text):
    assert classify_failure(text) == "peer"


@pytest.mark.parametrize("text", LOCAL_ERRORS)
def test_this_ranks_own_errors_are_local(text):
    assert classify_failure(text) == "local"


@pytest.mark.parametrize("text", [
    "OSError: [Errno 28] No space left on device",
    "CheckpointException: CheckpointException ranks:dict_keys([0])\nTraceback ... OSError: "
    "[Errno 28] No space left on device: '/ckpt/step_00000012/__0_0.distcp'",
    "OSError: [Errno 30] Read-only file system: '/ckpt/step_00000004'",
])
def test_a_failing_filesystem_is_a_disk_failure(text):
    assert classify_failure(text) == "disk"


def test_an_unshared_checkpoint_dir_is_a_storage_failure_and_its_peers_are_not_blamed():
    assert classify_failure("StorageNotShared: checkpoint.dir is not shared: node-2 cannot see "
                            "/ckpt/.shared-x written by node-0") == "storage"
    assert classify_failure("PeerStorageNotShared: checkpoint.dir is not shared: another rank "
                            "cannot see /ckpt/.shared-x") == "peer"


@pytest.mark.parametrize(
    ("agreed", "done", "action"),
    [
        (Agreement(False, False, 0), 0, Action()),
        (Agreement(True, True, 5), 0, Action(leave_now=True)),
        (Agreement(False, True, 0), 0, Action(stop=True)),
        (Agreement(False, True, 2), 1, Action(stop=True)),
        (Agreement(False, False, 1), 0, Action(checkpoint=True)),
        (Agreement(False, False, 3), 1, Action(checkpoint=True)),
        # a request already done in this generation is not done again
        (Agreement(False, False, 2), 2, Action()),
    ],
)
def test_decide(agreed, done, action):
    assert decide(agreed, done) == action


def test_rpc_deadline_follows_the_fault_config():
    assert rpc_timeout(FaultConfig()) == 5.0
    assert rpc_timeout(FaultConfig(heartbeat_timeout_s=2.0)) == 2.0
    # never longer than half the hang floor: peers must see this rank leave before their
    # own watchdogs call them hung
    assert rpc_timeout(FaultConfig(hang_floor_s=4.0)) == 2.0


def test_backoff_doubles_and_is_capped():
    fault = FaultConfig(backoff_s=0.5, backoff_max_s=3.0)
    delays, delay = [], None
    for _ in range(5):
        delay = next_backoff(delay, fault)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_store_prefix_falls_back_to_the_generation():
    env = WorkerEnv(node="n", local_rank=0, agent_socket="")
    plan = plan_generation(loads(JOB), [NodeInfo("n", 1)], 4, ("h", 1))

    def spec(prefix: str) -> GenerationSpec:
        gp = pb.GenerationPlan(generation=4, plan_json=plan.to_json(), store_prefix=prefix)
        return GenerationSpec.of(gp, env)

    assert spec("run-x/4").store_prefix == "run-x/4"
    assert spec("").store_prefix == "generation/4"
    assert spec("").plan == plan


def test_the_worker_environment_is_read_once_into_a_typed_description(tmp_path):
    env = WorkerEnv.from_environ({
        "ULTRA_NODE_ID": "n1", "ULTRA_LOCAL_RANK": "3", "ULTRA_AGENT_SOCKET": "/s",
        "ULTRA_SNAPSHOT_ROOT": str(tmp_path),
        "ULTRA_FAULT_FAIL_AT_STEP": "5", "ULTRA_FAULT_NAN_STEPS": "2-3"})
    assert (env.node, env.local_rank, env.agent_socket, env.snapshot_root) == \
        ("n1", 3, "/s", tmp_path)
    assert env.faults is not None and env.faults.fail_at_step == 5
    assert env.nonfinite is not None and (env.nonfinite.first, env.nonfinite.last) == (2, 3)
    bare = WorkerEnv.from_environ({})
    assert (bare.snapshot_root, bare.faults, bare.nonfinite) == (None, None, None)


@pytest.mark.parametrize(
    ("env", "fails_at"),
    [
        ({}, None),
        ({"ULTRA_FAULT_FAIL_AT_STEP": "3"}, 3),
        (
            {
                "ULTRA_FAULT_FAIL_AT_STEP": "3",
                "ULTRA_NODE_ID": "node-2",
                "ULTRA_FAULT_FAIL_NODES": "node-1, node-2",
            },
            3,
        ),
        (
            {
                "ULTRA_FAULT_FAIL_AT_STEP": "3",
                "ULTRA_NODE_ID": "node-3",
                "ULTRA_FAULT_FAIL_NODES": "node-1,node-2",
            },
            None,
        ),
    ],
)
def test_fault_injection_from_env(env, fails_at):
    faults = FaultInjection.from_env(env)
    assert (faults.fail_at_step if faults else None) == fails_at


def test_injected_fault_fires_at_its_step_every_time():
    faults = FaultInjection(3)
    faults.check(2)
    for _ in range(2):  # a restored run reaching step 3 again fails again
        with pytest.raises(RuntimeError, match="injected fault at step 3") as err:
            faults.check(3)
        assert classify_failure(f"{type(err.value).__name__}: {err.value}") == "local"
    faults.check(4)


def test_a_typo_in_the_fault_step_is_loud():
    with pytest.raises(ValueError):
        FaultInjection.from_env({"ULTRA_FAULT_FAIL_AT_STEP": "three"})


def test_heartbeat_beats_the_current_phase_and_survives_errors():
    beats: list[tuple[int, str, int]] = []
    logs: list[str] = []
    failing = threading.Event()

    def send(generation: int, phase: str, step: int, deadline: float) -> None:
        assert 0 < deadline <= 0.05
        if failing.is_set():
            raise ConnectionError("agent gone")
        beats.append((generation, phase, step))

    beat = Heartbeat(send, logs.append, interval_s=0.05)
    beat.update(3, "join", 0)
    beat.start()
    time.sleep(0.2)
    beat.update(3, "step", 7)
    time.sleep(0.2)
    failing.set()
    time.sleep(0.3)
    failing.clear()
    time.sleep(0.2)
    beat.stop()
    assert (3, "join", 0) in beats and beats[-1] == (3, "step", 7)
    assert len(beats) >= 6
    # several failed beats, one log line (rate-limited), and beating resumed after them
    assert len(logs) == 1 and "agent gone" in logs[0]
    with pytest.raises(ValueError, match="phase"):
        beat.update(3, "training", 1)


MINIMAL = '[data]\nsource = "python-stdlib"\n'


@pytest.mark.parametrize(
    ("job", "ckpt", "expected"),
    [
        ('[job]\noutput_dir = "/out"\n', "ckpt", "/out/ckpt"),
        ('[job]\noutput_dir = "/out"\n', "/abs/ckpt", "/abs/ckpt"),
        ("", "ckpt", "ckpt"),
        ('[job]\noutput_dir = "/out"\n', "", None),
    ],
)
def test_checkpoint_dir_rule(job, ckpt, expected):
    cfg = loads(MINIMAL + job + f'[checkpoint]\ndir = "{ckpt}"\n')
    root = checkpoint_root(cfg)
    assert (str(root) if root is not None else None) == (
        str(Path(expected)) if expected is not None else None
    )
