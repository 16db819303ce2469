"""How ultractl finds and talks to a cluster's agents.

Where the endpoints and credentials come from, per field: the flag, else its `ULTRA_*`
variable (both arrive here as the parsed flag), else the context (`--context`, else
`ULTRA_CONTEXT`, else the config's current context).

Which agent answers: every endpoint is a candidate; ultractl connects to them in order, starting
the next one when the earlier ones failed or after a short stagger, and sends the request to
the first that is ready. A dead agent refuses at once and a stopped or unreachable one never
becomes ready, so neither holds a command up for long. A read (status, nodes, plan, events)
that fails with UNAVAILABLE moves on to the next agent; a change (submit, drain, ...) is
never re-sent, since the first agent may have applied it. When no agent could be reached at
all, nothing was sent: `Unreachable`, which ultractl reports with its own exit code so that a
script knows a retry is safe.

With a context, each successful command also asks the agent for the members' addresses and
records them in the context (`discovered`), so losing the agents the context was set up with
does not strand the CLI.

Where the admin token may go: to an agent whose TLS identity ultractl verifies (any endpoint,
when TLS is configured), or to loopback. An endpoint the operator named (flag, environment or
the context's `endpoint`) on another host without TLS is refused unless `--insecure` says clear
text is accepted. A discovered address comes from a node record in etcd, which whoever can
write etcd can forge, so without TLS it is used only when it is loopback, `--insecure` or not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from daemon.api.auth import call_metadata, is_loopback, split_host_port
from daemon.api.grpc_limits import MESSAGE_OPTIONS
from daemon.cli.ctlconfig import ContextError, load_context, save_discovered, split_endpoints
from daemon.secret_files import SecretFileError, read_secret
from daemon.tls_files import TLSFileError, client_credentials
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

# Calls that change nothing: safe to send again to another agent after UNAVAILABLE.
READS = frozenset({"GetStatus", "ListNodes", "GetPlan", "WatchEvents", "GetJob"})
STAGGER_S = 0.25  # how long one silent endpoint may hold up trying the next


class TargetError(ValueError):
    """Bad endpoints or credentials: a usage error (exit 2)."""


class Unreachable(ConnectionError):
    """No agent could be reached: the request was not sent."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused  # every connection failed, rather than none answering in time


@dataclass(frozen=True)
class TLSFiles:
    """PEM paths: the CA that verifies the agents, and a client certificate for mTLS."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def given(self) -> bool:
        return bool(self.ca or self.cert or self.key)


@dataclass(frozen=True)
class Target:
    endpoints: tuple[str, ...]
    token: str
    credentials: grpc.ChannelCredentials | None  # None: plain text
    context: str = ""       # the context the endpoints came from ("" = flag or environment)
    config: Path = Path()


def resolve_target(endpoint: str | None, token_file: str | None, tls: TLSFiles,
                   context: str, config: Path, insecure: bool = False) -> Target:
    """Flag-or-environment values first; the context fills what they leave out."""
    ctx = None
    if context or not endpoint or not token_file:
        try:
            ctx = load_context(config, context)
        except ContextError as exc:
            raise TargetError(str(exc)) from None
    from_context = ""
    if ctx is not None:
        if not endpoint:
            from_context = ctx.name
        token_file = token_file or ctx.token_file
        # A client certificate and its key come together, from one place.
        cert, key = (tls.cert, tls.key) if tls.cert or tls.key else (
            ctx.tls_cert or None, ctx.tls_key or None)
        tls = TLSFiles(tls.ca or ctx.tls_ca or None, cert, key)
    if not endpoint and ctx is None:
        raise TargetError("no endpoint: pass --endpoint, set ULTRA_ENDPOINT, or set up a "
                          f"context (ultractl config set-context) in {config}")
    try:
        named = split_endpoints(endpoint) if endpoint else split_endpoints(
            ctx.endpoint, f"contexts.{ctx.name}.endpoint")  # type: ignore[union-attr]
    except ContextError as exc:
        raise TargetError(str(exc)) from None
    discovered = ctx.discovered if not endpoint and ctx is not None else ()
    try:
        token = read_secret(Path(token_file).expanduser(), "--token-file") if token_file else ""
        credentials = client_credentials(*(Path(f).expanduser() if f else None
                                           for f in (tls.ca, tls.cert, tls.key))
                                         ) if tls.given() else None
    except (SecretFileError, TLSFileError) as exc:
        raise TargetError(str(exc)) from None
    endpoints = token_endpoints(named, discovered, tls=credentials is not None,
                                insecure=insecure)
    return Target(endpoints, token, credentials, from_context, config)


def token_endpoints(named: tuple[str, ...], discovered: tuple[str, ...], *, tls: bool,
                    insecure: bool) -> tuple[str, ...]:
    """The endpoints that may receive the token, named ones first (docstring above)."""
    if tls:
        return tuple(dict.fromkeys([*named, *discovered]))
    remote = [e for e in named if not is_loopback(split_host_port(e)[0])]
    if remote and not insecure:
        raise TargetError(
            f"{remote[0]} is not a loopback address and no TLS is configured (--tls-ca, "
            "--tls-cert/--tls-key): the token would cross the network in clear text; configure "
            "TLS or pass --insecure")
    local = [e for e in discovered if is_loopback(split_host_port(e)[0])]
    return tuple(dict.fromkeys([*named, *local]))


class Agents:
    """An AgentStub over a cluster: `agents.GetStatus(request, timeout=..., metadata=...)`."""

    def __init__(self, target: Target, connect_timeout: float) -> None:
        self.target = target
        self.metadata = call_metadata(target.token) if target.token else ()
        self._connect_timeout = connect_timeout
        creds = target.credentials
        self._channels = [grpc.secure_channel(e, creds, MESSAGE_OPTIONS) if creds
                          else grpc.insecure_channel(e, MESSAGE_OPTIONS) for e in target.endpoints]
        self._cond = threading.Condition()
        self._ready = [False] * len(self._channels)
        self._failed = [False] * len(self._channels)
        self._started = 0
        self._discovered = False

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def _on_state(self, i: int, state: grpc.ChannelConnectivity) -> None:
        with self._cond:
            self._ready[i] = state == grpc.ChannelConnectivity.READY
            self._failed[i] = self._failed[i] or state in (
                grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)
            self._cond.notify_all()

    def _start_next(self) -> None:
        i = self._started
        self._started += 1
        self._channels[i].subscribe(partial(self._on_state, i), try_to_connect=True)

    def _pick(self, skip: set[int]) -> int:
        """The first ready agent not in `skip`, connecting to more as needed."""
        n = len(self._channels)
        deadline = time.monotonic() + self._connect_timeout
        next_start = 0.0
        with self._cond:
            while True:
                ready = [i for i in range(n) if self._ready[i] and i not in skip]
                if ready:
                    return ready[0]
                now = time.monotonic()
                live = [i for i in range(self._started) if i not in skip and not self._failed[i]]
                if self._started < n and (not live or now >= next_start):
                    self._start_next()
                    next_start = now + STAGGER_S
                    continue
                at = ", ".join(self.target.endpoints)
                if not live:
                    why = "every agent was unavailable" if skip else "every connection failed"
                    raise Unreachable(f"cannot reach any agent at {at} ({why})", refused=not skip)
                if now >= deadline:
                    raise Unreachable(f"cannot reach any agent at {at} (none ready within "
                                      f"{self._connect_timeout:g}s)")
                wait = deadline - now
                if self._started < n:
                    wait = min(wait, next_start - now)
                self._cond.wait(max(wait, 0.001))

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return partial(self._call, method)

    def _call(self, method: str, request: Any, **kwargs: Any) -> Any:
        skip: set[int] = set()
        while True:
            try:
                i = self._pick(skip)
            except Unreachable as exc:
                if not exc.refused:
                    raise
                raise Unreachable(f"{exc}; {self.target.endpoints[0]}: {self._why_failed(0)}",
                                  refused=True) from None
            stub = pb_grpc.AgentStub(self._channels[i])
            try:
                reply = getattr(stub, method)(request, **kwargs)
                if method == "WatchEvents":
                    # A stream fails on its first message, not at the call.
                    first = next(iter(reply), None)
                    reply = _chain(first, reply)
            except grpc.RpcError as exc:
                if method in READS and exc.code() == grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
                    skip.add(i)
                    continue
                raise
            self._discover(i)
            return reply

    def _why_failed(self, i: int) -> str:
        """gRPC's account of a failed connection (refused, TLS handshake, ...).

        The channel keeps its last connection error only for calls, so this sends one read,
        which cannot change anything even if the agent has come back meanwhile.
        """
        try:
            pb_grpc.AgentStub(self._channels[i]).GetStatus(
                pb.GetStatusRequest(), timeout=self._connect_timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
        return "answered on a second try"

    def _discover(self, i: int) -> None:
        """Record the members' addresses in the context, once per command."""
        if not self.target.context or self._discovered:
            return
        self._discovered = True
        try:
            nodes = pb_grpc.AgentStub(self._channels[i]).ListNodes(
                pb.ListNodesRequest(), timeout=self._connect_timeout, metadata=self.metadata)
            save_discovered(self.target.config, self.target.context,
                            reachable_addresses(n.address for n in nodes.nodes))
        except (grpc.RpcError, ContextError, OSError):
            # Best effort: the command itself succeeded, and the next one tries again.
            pass


def reachable_addresses(addresses: Iterable[str]) -> list[str]:
    """Addresses a client can dial: a wildcard host (0.0.0.0, ::) names no machine."""
    out = []
    for address in addresses:
        host = address.rpartition(":")[0].strip("[]")
        if host and host not in ("0.0.0.0", "::"):
            out.append(address)
    return out


def _chain(first: Any, rest: Iterable[Any]) -> Iterator[Any]:
    if first is not None:
        yield first
        yield from rest
