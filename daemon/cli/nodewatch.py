"""Kubernetes cordon -> ultrascale drain: the node-watch sidecar of deploy/k8s's DaemonSet.

`kubectl drain` cordons a node and then evicts its pods, except those of a DaemonSet: it never
stops them (the DaemonSet controller would put them straight back), so the agent would keep
training until the node goes down, and the job would take the failure path. This watcher reads
its own Node object from the Kubernetes API; when the node becomes unschedulable (a cordon, the
first thing a drain does) it asks the agent to drain through the same RPC as `ultractl drain`:
the running generation stops at the next step boundary after a durable checkpoint and the job
goes on without this node. When the node is schedulable again it uncordons the agent, which
then rejoins. A node that is already cordoned when the watcher starts (the pod was restarted on
it) is drained at once.

    python -m daemon.cli.nodewatch --node NODE [--interval S] [--api-url URL] [--token-file F]
                                   [--ca-file F]

The agent is reached as ultractl reaches it: ULTRA_ENDPOINT, ULTRA_TOKEN_FILE, ULTRA_TLS_CA,
ULTRA_TLS_CERT, ULTRA_TLS_KEY. The API server, token and CA default to what the pod's service
account provides (KUBERNETES_SERVICE_HOST/PORT and the projected token). The watcher needs
`get` on nodes (deploy/k8s/nodewatch-rbac.yaml). Exit codes: 2 usage; otherwise it runs until
SIGTERM/SIGINT. docs/kubernetes.md, "Node drains".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import ssl
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from daemon.cli import ultractl

log = logging.getLogger("nodewatch")

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API_TIMEOUT_S = 10.0


class ApiError(Exception):
    pass


@dataclass(frozen=True)
class NodeApi:
    """GET /api/v1/nodes/NAME with the service account's bearer token."""

    url: str
    token_file: Path
    ca_file: Path | None

    def _context(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https://"):
            return None
        return ssl.create_default_context(
            cafile=str(self.ca_file) if self.ca_file is not None else None)

    def unschedulable(self, node: str) -> bool:
        """Whether the node is cordoned (spec.unschedulable)."""
        # The token is re-read on every call: the kubelet rotates projected tokens.
        token = self.token_file.read_text().strip()
        request = urllib.request.Request(
            f"{self.url.rstrip('/')}/api/v1/nodes/{urllib.parse.quote(node, safe='')}",
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=API_TIMEOUT_S,
                                        context=self._context()) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:
            raise ApiError(f"GET node {node}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ApiError(f"GET node {node}: {exc}") from None
        return bool(body.get("spec", {}).get("unschedulable", False))


@dataclass
class Watcher:
    """One node's cordon state mirrored onto its agent. `ctl` runs an ultractl command line
    and returns its exit code."""

    api: NodeApi
    node: str
    ctl: Callable[[list[str]], int]
    # None until the first poll: a watcher (re)started on a schedulable node does not know
    # whether it drained the agent before, and leaves an operator's `ultractl drain` alone.
    drained: bool | None = None

    def poll(self) -> None:
        cordoned = self.api.unschedulable(self.node)
        if cordoned and not self.drained:
            log.info("node %s is cordoned: draining its agent", self.node)
            if self.ctl(["drain", self.node]) == 0:
                self.drained = True
        elif not cordoned and self.drained:
            log.info("node %s is schedulable again: uncordoning its agent", self.node)
            if self.ctl(["uncordon", self.node]) == 0:
                self.drained = False
        elif self.drained is None:
            self.drained = False

    def run(self, interval: float, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.poll()
            except ApiError as exc:
                log.warning("%s; retrying in %.0fs", exc, interval)
            stop.wait(interval)


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    default_url = f"https://{host}:{port}" if host else None
    p = argparse.ArgumentParser(prog="nodewatch", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--node", required=True, help="this pod's node (spec.nodeName)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between polls")
    p.add_argument("--api-url", default=default_url,
                   help="the API server (default from KUBERNETES_SERVICE_HOST/PORT)")
    p.add_argument("--token-file", type=Path, default=SERVICE_ACCOUNT / "token")
    p.add_argument("--ca-file", type=Path, default=SERVICE_ACCOUNT / "ca.crt")
    return p


def _ctl(env: Mapping[str, str]) -> Callable[[list[str]], int]:
    def call(argv: list[str]) -> int:
        code = ultractl.main(argv, env)
        if code != 0:
            log.warning("ultractl %s exited %d; retrying at the next poll", " ".join(argv), code)
        return code
    return call


def main(argv: Sequence[str] | None = None) -> int:
    env = dict(os.environ)
    try:
        args = _parser(env).parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if args.api_url is None:
        print("nodewatch: --api-url not given and KUBERNETES_SERVICE_HOST is not set",
              file=sys.stderr)
        return 2
    if args.interval <= 0:
        print(f"nodewatch: --interval must be > 0 (got {args.interval})", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ca = args.ca_file if args.ca_file.is_file() else None
    watcher = Watcher(NodeApi(args.api_url, args.token_file, ca), args.node, _ctl(env))
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("watching node %s at %s every %.0fs", args.node, args.api_url, args.interval)
    watcher.run(args.interval, stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
