"""The persistent worker an ultrad agent runs: one process per device, many generations.

`python -m trainer.worker` (started by the agent's supervisor, never by hand) loops: ask the
agent for the next generation, run this rank's part in it (trainer/generation.py: join its
process group through the agent-hosted TCPStore, rebuild the layout on the new mesh, restore,
train until told to stop or until the job is done, leave the process group), and ask again. A
healthy survivor of a failure therefore pays neither a process start nor a torch import on
recovery. The contract with the agent is the WorkerControl service in
proto/ultrascale/v1/agent.proto.

- A heartbeat thread reports the phase (idle, join, restore, step, checkpoint) every second.
- An agent that misses a call's deadline is asked again, backing off while it is silent.
- A failure is reported with its kind: "peer" (a collective, the rendezvous or the agent
  failed) or "local" (this rank's own error), see trainer.failure_kind.

Testing aid: `ULTRA_FAULT_FAIL_AT_STEP=N` [`ULTRA_FAULT_FAIL_NODES=node-1,...`] makes the
worker raise a local `RuntimeError("injected fault at step N")` right after completing step N,
each time it gets there; `ULTRA_FAULT_HANG_AT_STEP=N` makes it hang there (trainer.fault_injection).

Environment (set by the agent), read once at start into a `WorkerEnv` (trainer/world.py, where
each generation's world is built from it and the agent's plan): ULTRA_AGENT_SOCKET,
ULTRA_STEP_SOCKET (where the step reports go, trainer/step_socket.py),
ULTRA_LOCAL_RANK, ULTRA_NODE_ID, ULTRA_SNAPSHOT_ROOT (where this node's in-memory snapshots
live; unset: none are taken), the fault injections; and, read where they act,
ULTRA_WORKER_THREADS (before torch runs anything, the standby's too), ULTRA_AGENT_PID
(trainer.agent_death) and ULTRA_STACKS_FD (where SIGUSR1 dumps the Python stacks,
trainer.stack_dump).
"""

from __future__ import annotations

# First, before torch: arms the parent-death signal of a worker started by an agent, and its
# answer to a request for its stacks (a worker stuck importing torch can still answer).
from trainer.agent_death import die_with_agent
from trainer.stack_dump import answer_stack_requests

# isort: split
import os
import sys
import time

import torch

from parallel.job import FaultConfig
from trainer.agent_link import AgentLink, AgentUnreachable
from trainer.generation import run_one
from trainer.heartbeat import Heartbeat
from trainer.model_ahead import ModelAhead
from trainer.standby import await_role, is_standby
from trainer.teardown import Teardown, freeze_import_heap
from trainer.thread_names import name_thread
from trainer.warm_up import warm_up
from trainer.worker_log import log
from trainer.world import WorkerEnv


def name_process(name: str) -> None:
    """What `ps -o comm`, top and /proc/<pid>/comm show: `ultra-w<local rank>` for a worker,
    `ultra-standby` for the standby until it takes a rank (threads started later inherit it)."""
    name_thread(name)


def next_backoff(previous: float | None, fault: FaultConfig) -> float:
    """backoff_s, then doubled on each consecutive miss, capped at backoff_max_s."""
    return fault.backoff_s if previous is None else min(2 * previous, fault.backoff_max_s)


def main() -> int:
    die_with_agent()  # again: also without ULTRA_AGENT_PID (a test's own launcher)
    answer_stack_requests()
    torch.set_num_threads(int(os.environ.get("ULTRA_WORKER_THREADS", "1")))
    freeze_import_heap()
    teardown = Teardown()
    ahead = ModelAhead()  # the next generation's model, built while the agent plans it
    teardown.refresh()  # now, not between a failure and the next join
    if is_standby(os.environ):
        name_process("ultra-standby")
        seconds = warm_up(teardown, log)
        freeze_import_heap()  # what the warm-up imported stays, like torch's own modules
        log(f"standby: torch imported and warmed up ({seconds:.2f}s), waiting for a local rank")
        role = await_role(sys.stdin.buffer)
        if role is None:
            return 0
        log(f"standby: taking local rank {role}")
    env = WorkerEnv.from_environ(os.environ)  # the standby's, once it took its rank
    name_process(f"ultra-w{env.local_rank}")
    link = AgentLink(env.agent_socket, env.local_rank, step_socket=env.step_socket)
    beat = Heartbeat(link.heartbeat, log).start()
    fault = FaultConfig()  # the last joined job's, once there is one
    generation, delay = 0, None
    while True:
        try:
            gp = link.next_generation(generation)
        except AgentUnreachable as exc:
            delay = next_backoff(delay, fault)
            log(f"{exc}; asking again in {delay:.1f}s")
            time.sleep(delay)
            continue
        delay = None
        if gp.exit:
            log("the agent says exit")
            # Free a failed generation's world now: freed by interpreter shutdown instead, its
            # gloo threads can abort the process (exit -6 for an orderly exit).
            teardown.release()
            beat.stop()
            link.close()
            return 0
        generation = gp.generation
        if gp.global_rank < 0:
            teardown.release()  # no part in this generation: no first step to wait for
            continue
        outcome = run_one(link, beat, gp, env, teardown, ahead)
        fault = link.fault
        log(f"generation {gp.generation} {outcome.kind} at step {outcome.step}")


if __name__ == "__main__":
    sys.exit(main())
