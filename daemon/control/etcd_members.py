"""The agent's gRPC channels to etcd's members: one per member, one member used at a time.

Each member's channel is dialled by exactly the name or address it was given (gRPC's `dns:`
resolver), so names such as `etcd-0.etcd.<ns>.svc` resolve and TLS checks every member's
certificate for its own name; a single channel over an address list would check all members
against one name. To start using a member, it is asked something cheap (Authenticate with
etcd auth, else Maintenance.Status); a member that does not answer is logged at WARNING with
gRPC's reason, once until it answers again, and the next one is tried. A call that later finds
its member unreachable moves the next call to the next member; the call itself is re-sent by
the caller's retry (with backoff), never here, since a lost answer may hide an applied txn.
docs/multi-host.md, "etcd members".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
import grpc
from aetcd import rpc

log = logging.getLogger(__name__)


class EtcdUnreachable(ConnectionError):
    """No etcd member answered (each one's reason is in the message and was logged)."""


# The codes with which a call fails when the member did not answer it (not reachable, TLS
# handshake refused, name not resolved, or no answer in time).
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def unreachable_reason(exc: BaseException) -> str | None:
    """gRPC's account of why the member did not answer, or None when it did (it refused)."""
    err = exc if isinstance(exc, grpc.aio.AioRpcError) else exc.__cause__
    if isinstance(err, grpc.aio.AioRpcError) and err.code() in _UNREACHABLE:
        return f"{err.code().name}: {err.details()}"
    return None


@dataclass(frozen=True)
class Endpoint:
    url: str     # as the operator would recognise it, for messages
    target: str  # gRPC target: host:port, resolved by gRPC's dns: resolver


def endpoints_of(hosts: Sequence[tuple[str, int]], tls: bool) -> list[Endpoint]:
    scheme = "https" if tls else "http"
    out = []
    for host, port in hosts:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        out.append(Endpoint(f"{scheme}://{address}", address))
    return out


class MemberClient(aetcd.Client):
    """aetcd's calls over channels opened here (TLS or not), one per etcd member, with etcd's
    auth token (the token is a member's own: a new member means a new token)."""

    def __init__(self, endpoints: list[Endpoint], credentials: grpc.ChannelCredentials | None,
                 user: str, password: str, timeout: float, options: dict[str, Any]) -> None:
        super().__init__(host=endpoints[0].target, timeout=timeout,  # type: ignore[arg-type]
                         options=options)
        self._endpoints = endpoints
        self._credentials = credentials
        self._user = user
        self._password = password
        self._lock = asyncio.Lock()
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._current = 0
        self._failing: set[int] = set()  # warned about, and not known to answer since

    @property
    def authenticates(self) -> bool:
        return bool(self._user)

    @property
    def endpoint(self) -> Endpoint:
        return self._endpoints[self._current]

    def _channel(self, i: int) -> grpc.aio.Channel:
        if i not in self._channels:
            target, options = self._endpoints[i].target, list(self._options.items())
            self._channels[i] = (
                grpc.aio.secure_channel(target, self._credentials, options)
                if self._credentials is not None
                else grpc.aio.insecure_channel(target, options))
        return self._channels[i]

    async def connect(self) -> None:
        """Use the current member, else the next one that answers; each one that does not is
        logged with gRPC's reason. A member that answers but refuses (a wrong password) is not
        skipped: the refusal is raised."""
        if self._connected.is_set():
            return
        async with self._lock:
            if self._connected.is_set():
                return
            n = len(self._endpoints)
            reasons = []
            for i in ((self._current + k) % n for k in range(n)):
                channel = self._channel(i)
                try:
                    metadata = await self._probe(channel)
                except grpc.aio.AioRpcError as exc:
                    reason = unreachable_reason(exc)
                    if reason is None:
                        raise
                    self._report(i, reason)
                    reasons.append(f"{self._endpoints[i].url}: {reason}")
                    continue
                if channel is not self.channel:
                    log.info("etcd: using %s", self._endpoints[i].url)
                self._answered(i)
                self._current = i
                self.channel, self.metadata = channel, metadata
                self.kvstub = rpc.KVStub(channel)
                self.clusterstub = rpc.ClusterStub(channel)
                self.leasestub = rpc.LeaseStub(channel)
                self.maintenancestub = rpc.MaintenanceStub(channel)
                self._connected.set()
                return
            raise EtcdUnreachable("no etcd endpoint answered: " + "; ".join(reasons))

    async def _probe(self, channel: grpc.aio.Channel) -> Any:
        """One cheap call that proves the member answers; with etcd auth, the token's metadata."""
        if not self._user:
            await rpc.MaintenanceStub(channel).Status(rpc.StatusRequest(),
                                                      timeout=self._timeout)
            return None
        resp = await rpc.AuthStub(channel).Authenticate(
            rpc.AuthenticateRequest(name=self._user, password=self._password),
            timeout=self._timeout)
        return (("token", resp.token),)

    def _report(self, i: int, reason: str) -> None:
        """Warn once per failure of a member, not once per call while it stays down."""
        if i not in self._failing:
            self._failing.add(i)
            log.warning("etcd endpoint %s unreachable: %s", self._endpoints[i].url, reason)

    def _answered(self, i: int) -> None:
        if i in self._failing:
            self._failing.discard(i)
            log.info("etcd endpoint %s answers again", self._endpoints[i].url)

    def on_result(self, channel: Any, exc: BaseException | None) -> None:
        """A call on `channel` ended (`exc`: how it failed). A member that did not answer is
        reported, and with other members to try, the next call connects to the next one."""
        if channel is None or channel is not self.channel:
            return  # a call on a member already left behind
        if exc is None:
            self._answered(self._current)
            return
        reason = unreachable_reason(exc)
        if reason is None:
            return
        self._report(self._current, reason)
        if len(self._endpoints) > 1:
            # The channel stays open (closing it would cancel other tasks' calls on it); the
            # next connect() starts with the member after this one.
            self._current = (self._current + 1) % len(self._endpoints)
            self._connected.clear()

    async def _authenticate(self) -> None:
        resp = await rpc.AuthStub(self.channel).Authenticate(
            rpc.AuthenticateRequest(name=self._user, password=self._password),
            timeout=self._timeout)
        self.metadata = (("token", resp.token),)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        self._connected.clear()
        self._init_channel_attrs()
        for channel in channels:
            await channel.close()

    async def reauthenticate(self, stale: Any) -> None:
        """A fresh token, unless another task already replaced `stale`."""
        async with self._lock:
            if self._user and self.channel is not None and self.metadata == stale:
                await self._authenticate()
                log.info("etcd refused the auth token (restart or expiry); re-authenticated "
                         "as %s", self._user)
