"""ultractl's job lifecycle commands: `job cancel`, `job get`, `wait`, `logs`.

    job cancel [--job NAME]      stop the job at the next step boundary after a durable
                                 checkpoint; it becomes `cancelled` (refused when it has ended,
                                 or when --job names another job)
    job get [-o toml|yaml|json]  the submitted spec (the TOML as submitted, its overrides, the
                                 validated config) and its revision
    wait [--for=state=STATE] [--timeout SECONDS]
                                 block until the job is in STATE (finished by default; also
                                 running, pending, failed, cancelled)
    logs NODE [--rank R] [--tail N] [-f]
                                 a worker's output (stderr and stdout) through NODE's agent

`wait` exits 0 when the job reached STATE, 1 when it reached another state it cannot leave
(finished, failed or cancelled), 2 on a usage error, 3 when no agent answered its first call,
4 when --timeout passed first (agents that stop answering meanwhile are retried until then).
`logs` asks the cluster for NODE's address and reads from that agent with the same token and
TLS settings; without TLS the address must be loopback (the token's rule, ctlconnect.py).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import yaml

from daemon.cli import completion
from daemon.cli.ctlconnect import (
    Agents,
    Target,
    Unreachable,
    reachable_addresses,
    token_endpoints,
)
from daemon.cli.ctlerrors import EXIT_FAILURE, EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE, CtlError
from proto.ultrascale.v1 import agent_pb2 as pb

GET_OUTPUTS = ("toml", "yaml", "json")
WAIT_STATES = ("finished", "cancelled", "failed", "running", "pending")
ENDED = frozenset({"finished", "failed", "cancelled"})
POLL_S = 0.5
WAIT_EXITS = ("Block until the job is in STATE. Exit codes: 0 the job reached STATE; 1 it "
              "reached another state it cannot leave (finished, failed, cancelled); 2 usage "
              "(a bad --for or --timeout); 3 no agent answered the first call; 4 --timeout "
              "passed first (agents that stop answering meanwhile are retried until then).")

Emit = Callable[[Any, str, Callable[[Any], Iterable[str]]], None]


def add_job_parsers(job: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cancel = job.add_parser("cancel", help="stop the job at a step boundary after a "
                                           "checkpoint (state: cancelled)")
    cancel.add_argument("--job", default="", metavar="NAME",
                        help="refuse unless the submitted job has this name")
    get = job.add_parser("get", help="the submitted spec and its revision",
                         own_flags=("-o", "--output"))
    fmt = get.add_argument("-o", "--output", dest="spec_output", default="", metavar="FORMAT",
                           help=f"{'|'.join(GET_OUTPUTS)} (default: toml, as submitted)")
    # Checked by the command, for a one-line error; completion still offers them.
    completion.offer(fmt, GET_OUTPUTS)


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    wait = sub.add_parser("wait", help="block until the job reaches a state "
                                       "(exit 0 reached, 1 another end, 4 timeout)",
                          own_flags=("--timeout",), description=WAIT_EXITS)
    target = wait.add_argument("--for", dest="wait_for", default="state=finished",
                               metavar="state=STATE",
                               help=f"STATE: {'|'.join(WAIT_STATES)} (default: state=finished)")
    completion.offer(target, tuple(f"state={s}" for s in WAIT_STATES))
    wait.add_argument("--timeout", dest="wait_timeout", default="", metavar="SECONDS",
                      help="give up after SECONDS (exit 4); default: wait as long as it takes")
    logs = sub.add_parser("logs", help="a worker's output, through its node's agent")
    logs.add_argument("node")
    logs.add_argument("--rank", type=int, default=0, metavar="R",
                      help="the worker's local rank (device index) on NODE (default 0)")
    logs.add_argument("--tail", type=int, default=100, metavar="N",
                      help="the last N lines (default 100, at most 10000)")
    logs.add_argument("-f", "--follow", action="store_true", help="then stream new lines")


# -- job cancel / job get ----------------------------------------------------------------------


def cancel(stub: Agents, md: Any, timeout: float, output: str, job: str, emit: Emit) -> int:
    reply = stub.CancelJob(pb.CancelJobRequest(job=job), timeout=timeout, metadata=md)
    emit({"job": reply.job, "revision": reply.revision, "request_id": reply.request_id}, output,
         lambda r: [f"job {r['job']} (revision {r['revision']}): cancel requested; it stops at "
                    "the next step boundary after a checkpoint (ultractl wait "
                    "--for=state=cancelled)"])
    return EXIT_OK


def get_output(given: str) -> str:
    fmt = given or "toml"
    if fmt not in GET_OUTPUTS:
        raise CtlError(f"job get -o: expected one of {', '.join(GET_OUTPUTS)} (got {fmt!r})",
                       EXIT_USAGE)
    return fmt


def get(stub: Agents, md: Any, timeout: float, fmt: str) -> int:
    reply = stub.GetJob(pb.GetJobRequest(), timeout=timeout, metadata=md)
    data = {"job": reply.job, "revision": reply.revision, "state": reply.state,
            "submitted_at": reply.submitted_at, "overrides": list(reply.overrides),
            "spec_toml": reply.spec_toml, "config": json.loads(reply.config_json or "{}")}
    if fmt == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
    elif fmt == "yaml":
        print(yaml.safe_dump(data, sort_keys=True), end="")
    else:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(reply.submitted_at))
        print(f"# job {reply.job}, revision {reply.revision}, submitted {when}, "
              f"state {reply.state}")
        for override in reply.overrides:
            print(f"# --set {override}")
        print(reply.spec_toml, end="" if reply.spec_toml.endswith("\n") else "\n")
    return EXIT_OK


# -- wait --------------------------------------------------------------------------------------


def wait_target(text: str) -> str:
    key, _, state = text.partition("=")
    if key != "state" or state not in WAIT_STATES:
        raise CtlError(f"wait --for: expected state=STATE, STATE one of "
                       f"{', '.join(WAIT_STATES)} (got {text!r})", EXIT_USAGE)
    return state


def wait_seconds(text: str) -> float | None:
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise CtlError(f"wait --timeout: expected seconds > 0 (got {text!r})", EXIT_USAGE)
    return value


def wait(stub: Agents, md: Any, call_timeout: float, state: str, limit: float | None) -> int:
    deadline = None if limit is None else time.monotonic() + limit
    first, last = True, ""
    while True:
        try:
            status = stub.GetStatus(pb.GetStatusRequest(), timeout=call_timeout, metadata=md)
        except (Unreachable, grpc.RpcError) as exc:
            if first:
                raise  # nothing answered at all: the usual exit 3 (or 1)
            status, last = None, str(exc) if isinstance(exc, Unreachable) else \
                f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
        first = False
        if status is not None:
            if status.state == state:
                print(f"job {status.job}: {state}" + (f" ({status.reason})" if status.reason
                                                      else ""))
                return EXIT_OK
            if status.state in ENDED:
                raise CtlError(f"wait: job {status.job} is {status.state}, not {state}"
                               + (f" ({status.reason})" if status.reason else ""), EXIT_FAILURE)
            last = f"job {status.job or '-'} is {status.state}"
        if deadline is not None and time.monotonic() >= deadline:
            raise CtlError(f"wait: timed out after {limit:g}s waiting for state={state} "
                           f"({last})", EXIT_TIMEOUT)
        pause = POLL_S if deadline is None else max(0.0, min(POLL_S,
                                                             deadline - time.monotonic()))
        time.sleep(pause)


# -- logs --------------------------------------------------------------------------------------


def node_agent(stub: Agents, md: Any, timeout: float, node: str, insecure: bool) -> Agents:
    """An Agents on `node`'s own agent, with the cluster target's token and TLS."""
    reply = stub.ListNodes(pb.ListNodesRequest(), timeout=timeout, metadata=md)
    found = {n.node: n.address for n in reply.nodes}
    if node not in found:
        raise CtlError(f"logs: unknown node {node!r} (members: "
                       f"{', '.join(sorted(found)) or 'none'})", EXIT_FAILURE)
    target: Target = stub.target
    addresses = reachable_addresses([found[node]])
    endpoints = token_endpoints((), tuple(addresses), tls=target.credentials is not None,
                                insecure=insecure)
    if not endpoints:
        raise CtlError(f"logs: node {node!r} is at {found[node]}, which is not a loopback "
                       "address, and no TLS is configured: the token would cross the network "
                       "in clear text (configure TLS: --tls-ca)", EXIT_USAGE)
    return Agents(Target(endpoints, target.token, target.credentials), timeout)


def logs(stub: Agents, md: Any, timeout: float, args: argparse.Namespace) -> int:
    if args.tail < 1:
        raise CtlError(f"logs --tail: expected lines >= 1 (got {args.tail})", EXIT_USAGE)
    if args.rank < 0:
        raise CtlError(f"logs --rank: expected a local rank >= 0 (got {args.rank})", EXIT_USAGE)
    agent = node_agent(stub, md, timeout, args.node, args.insecure)
    if args.follow:
        # -f ends on Ctrl-C or `kill -INT`, even when started in the background by a
        # non-interactive shell, which hands SIGINT down ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stream = agent.ReadWorkerLog(
            pb.WorkerLogRequest(node=args.node, local_rank=args.rank, tail_lines=args.tail,
                                follow=args.follow),
            timeout=None if args.follow else timeout, metadata=md)
        out = sys.stdout.buffer
        for chunk in stream:
            out.write(chunk.data)
            out.flush()
    finally:
        agent.close()
    return EXIT_OK


LifecycleRun = Callable[[Agents, Any], int]


def command(args: argparse.Namespace, emit: Emit) -> LifecycleRun | None:
    """The lifecycle command `args` names, its flags checked now (a usage error is one line and
    exit 2 before anything is sent), to run once connected; None for any other command."""
    t, job_command = args.timeout, getattr(args, "job_command", "")
    if args.command == "wait":
        state, limit = wait_target(args.wait_for), wait_seconds(args.wait_timeout)
        return lambda stub, md: wait(stub, md, t, state, limit)
    if args.command == "logs":
        return lambda stub, md: logs(stub, md, t, args)
    if args.command == "job" and job_command == "cancel":
        return lambda stub, md: cancel(stub, md, t, args.output, args.job, emit)
    if args.command == "job" and job_command == "get":
        fmt = get_output(args.spec_output)
        return lambda stub, md: get(stub, md, t, fmt)
    return None
