"""One generation's world on the worker side, built in one place from a typed description.

`WorkerEnv` is what the agent tells a worker through its environment (daemon/node/supervisor.py
sets it; the snapshot root comes from daemon/node/snapshot_keeper.py), read once when the
worker starts, so nothing below reads the environment. `GenerationSpec` adds what the agent's
`GetGeneration` answer says: the plan, decoded once, and this rank's place in it.
`build_world` turns a spec into a running world: the process group joined through the store
the plan names, the device mesh, the model, optimizer, data, checkpoints and snapshots
(`GenerationDriver`), and the function that fetches the plan's snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from checkpoint.snapshot_reader import Fetch, local_first_fetch
from parallel.job import process_group_timeout
from parallel.mesh import build_mesh
from parallel.planner import Plan
from proto.ultrascale.v1 import agent_pb2 as pb
from trainer.driver import GenerationDriver, checkpoint_root, output_dir, select_device
from trainer.fault_injection import FaultInjection, NonFiniteInjection
from trainer.model_ahead import ModelAhead
from trainer.shared_storage import check_shared


@dataclass(frozen=True)
class WorkerEnv:
    """A worker's environment, as its agent set it."""

    node: str  # ULTRA_NODE_ID
    local_rank: int  # ULTRA_LOCAL_RANK
    agent_socket: str  # ULTRA_AGENT_SOCKET
    step_socket: str = ""  # ULTRA_STEP_SOCKET
    snapshot_root: Path | None = None  # ULTRA_SNAPSHOT_ROOT: None, this agent keeps none
    faults: FaultInjection | None = None  # ULTRA_FAULT_FAIL_AT_STEP, ..._HANG_AT_STEP
    nonfinite: NonFiniteInjection | None = None  # ULTRA_FAULT_NAN_STEPS, ...

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> WorkerEnv:
        root = env.get("ULTRA_SNAPSHOT_ROOT", "")
        return cls(node=env.get("ULTRA_NODE_ID", ""),
                   local_rank=int(env.get("ULTRA_LOCAL_RANK", "0")),
                   agent_socket=env.get("ULTRA_AGENT_SOCKET", ""),
                   step_socket=env.get("ULTRA_STEP_SOCKET", ""),
                   snapshot_root=Path(root) if root else None,
                   faults=FaultInjection.from_env(env),
                   nonfinite=NonFiniteInjection.from_env(env))


@dataclass(frozen=True)
class GenerationSpec:
    """Everything one generation's world on this rank is built from."""

    gp: pb.GenerationPlan  # the agent's answer: generation, ranks, the store
    plan: Plan  # gp.plan_json, decoded once
    env: WorkerEnv

    @classmethod
    def of(cls, gp: pb.GenerationPlan, env: WorkerEnv) -> GenerationSpec:
        return cls(gp, Plan.from_json(gp.plan_json), env)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=process_group_timeout(self.plan.job.fault))

    @property
    def store_prefix(self) -> str:
        return self.gp.store_prefix or f"generation/{self.gp.generation}"


@dataclass
class StartSeconds:
    """Where a generation's start went on this rank, in seconds: joining the process group
    (the TCPStore and gloo's connections), the device mesh's groups, the model, optimizer and
    data (`GenerationDriver`); the rank-0 log line of each generation prints them."""

    join: float = 0.0
    mesh: float = 0.0
    build: float = 0.0

    def describe(self) -> str:
        return f"joined in {self.join:.3f}s, mesh {self.mesh:.3f}s, built {self.build:.3f}s"


@dataclass
class World:
    driver: GenerationDriver
    fetch: Fetch | None  # the plan's snapshot, this node's share first (None: no snapshots)
    started: StartSeconds = field(default_factory=StartSeconds)


def join_world(spec: GenerationSpec, backend: str) -> None:
    """Join the generation through the agent-hosted store, under the plan's key prefix."""
    gp, timeout = spec.gp, spec.timeout
    store = dist.TCPStore(gp.store_host, gp.store_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(spec.store_prefix, store),
                            rank=gp.global_rank, world_size=gp.world_size, timeout=timeout)


def build_world(spec: GenerationSpec, remote_fetch: Callable[[int], Fetch],
                phase: Callable[[str], None], log: Callable[[str], None],
                ahead: ModelAhead | None = None) -> World:
    """Join, build the mesh and the driver; `phase(name)` is told when the join is done and
    the restore begins (the heartbeat's phases); `remote_fetch(step)` fetches a snapshot
    through the agent; `ahead` may hold the job's module, built while the plan was made."""
    job, layout, env = spec.plan.job, spec.plan.layout, spec.env
    device, backend, device_type = select_device(env.local_rank)
    began = time.perf_counter()
    join_world(spec, backend)
    joined = time.perf_counter()
    mesh = build_mesh(layout, device_type, spec.timeout)
    meshed = time.perf_counter()
    phase("restore")
    root = checkpoint_root(job)
    if root is not None and job.checkpoint.storage == "shared":
        check_shared(root, spec.gp.store_prefix, env.node or "?")
    driver = GenerationDriver(
        job, layout, mesh, device, timeout=spec.timeout, last_step=job.train.steps,
        generation=spec.gp.generation, step_log=output_dir(job) or Path("."), log=log,
        snapshot_root=env.snapshot_root, node=env.node,
        inject=env.nonfinite, model=ahead.take(job.model) if ahead is not None else None)
    step = spec.plan.restore.step
    fetch = local_first_fetch(env.snapshot_root, step, remote_fetch(step)) \
        if env.snapshot_root else None
    return World(driver, fetch, StartSeconds(joined - began, meshed - joined,
                                             time.perf_counter() - meshed))
