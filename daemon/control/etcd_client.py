"""The agent's etcd v3 client: aetcd for unary calls, aetcd's generated stubs for streams.

The gRPC channels are opened here, not by aetcd (aetcd 1.0 dials only in plain text): TLS when
the endpoints are https:// or TLS files are given (etcd_security.py), and with etcd's
user/password auth, the token from Auth.Authenticate travels as `token` metadata on every
call. etcd forgets simple tokens when it restarts and after `--auth-token-ttl` idle, so a call
refused for its token re-authenticates once and is retried.

Calls go to one etcd member at a time, over one channel per member that is dialled by its own
name (etcd_members.py: DNS names, TLS per member, failover, warnings).

Two streams are ours rather than aetcd's: aetcd's `Lease.refresh()` opens a new gRPC stream per
keepalive (at hundreds of agents that is most of both sides' CPU: docs/architecture.md,
"etcd keys"), so `KeepAlive`
holds ONE long-lived LeaseKeepAlive stream; and `watch` exposes etcd's revisions and
compaction so callers can resume exactly where they left off after etcd restarts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

import aetcd
import grpc
from aetcd import rpc
from aetcd.exceptions import ClientError
from aetcd.rpc import rpc_pb2

from daemon.control.etcd_members import EtcdUnreachable, MemberClient, endpoints_of
from daemon.control.etcd_security import EtcdSecurity

# Anything that means "etcd did not answer": callers retry these with backoff.
ETCD_ERRORS: tuple[type[BaseException], ...] = (
    ClientError, grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError, OSError,
)

T = TypeVar("T")
log = logging.getLogger(__name__)
PUT = rpc.Event.EventType.PUT
DELETE = rpc.Event.EventType.DELETE


class WatchCompacted(Exception):
    """The requested start revision was compacted away; the caller must re-read and resume."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"watch start revision compacted (oldest kept: {compact_revision})")
        self.compact_revision = compact_revision


def parse_endpoints(spec: str | Sequence[str]) -> list[tuple[str, int]]:
    """`http://h:2379,h2:2379` → [(h, 2379), (h2, 2379)]; bad entries raise ValueError."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        url = urlparse(item if "://" in item else f"http://{item}")
        if url.scheme not in ("http", "https") or not url.hostname or not url.port:
            raise ValueError(f"--etcd: expected host:port or http://host:port (got {item!r})")
        out.append((url.hostname, url.port))
    if not out:
        raise ValueError("--etcd: no endpoint given")
    return out


@dataclass(frozen=True)
class KV:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def _kv(raw: Any) -> KV:
    return KV(raw.key, raw.value, raw.create_revision, raw.mod_revision, raw.lease)


# etcd's answers to a call whose token it no longer knows (restart, TTL) or whose auth
# revision changed: re-authenticate and retry. A watch is cancelled with "permission denied".
_TOKEN_ERRORS = ("invalid auth token", "revision of auth store is old", "user name is empty")


def is_token_error(exc: BaseException) -> bool:
    text = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
    return any(marker in (text or "") for marker in _TOKEN_ERRORS)




class Etcd:
    """The etcd cluster, one member at a time; every call has a deadline of `timeout` seconds."""

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 2.0,
                 security: EtcdSecurity | None = None) -> None:
        hosts = parse_endpoints(endpoints)
        security = security or EtcdSecurity()
        tls = security.uses_tls(endpoints)
        options: dict[str, Any] = {
            # etcd answers pings more often than every 5 s (--grpc-keepalive-min-time) with
            # GOAWAY too_many_pings, dropping a connection that only holds a watch.
            "grpc.keepalive_time_ms": 10000, "grpc.keepalive_timeout_ms": 5000,
            "grpc.keepalive_permit_without_calls": 1,
            "grpc.initial_reconnect_backoff_ms": 100,
            "grpc.max_reconnect_backoff_ms": 1000,
        }
        self.endpoints = hosts
        self.timeout = timeout
        self.tls = tls
        self.client = MemberClient(endpoints_of(hosts, tls), security.credentials() if tls else None,
                              security.user, security.password(), timeout, options)
        self.tx = self.client.transactions

    async def connect(self) -> None:
        """Start on a member that answers, else carry on without one: each member that did not
        answer is logged, and every call connects again (an agent starts while etcd is down).
        A member that answers but refuses (a wrong password) raises."""
        with contextlib.suppress(EtcdUnreachable):
            await self.client.connect()

    async def close(self) -> None:
        await self.client.close()

    @property
    def channel(self) -> grpc.aio.Channel:
        return self.client.channel

    @property
    def metadata(self) -> Any:
        return self.client.metadata

    async def _authed(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, retried once with a fresh token when etcd refused the one it carried."""
        await self.client.connect()
        stale, channel = self.client.metadata, self.client.channel
        try:
            result = await call()
        except ETCD_ERRORS as exc:
            self.client.on_result(channel, exc)
            if not (self.client.authenticates and is_token_error(exc)):
                raise
        else:
            self.client.on_result(channel, None)
            return result
        await self.client.reauthenticate(stale)
        return await call()

    async def _on_stream_error(self, exc: BaseException, stale: Any, channel: Any) -> None:
        """A stream refused for its token: get a new one for the caller's next attempt; one
        whose member stopped answering: the next attempt goes to the next member."""
        self.client.on_result(channel, exc)
        if self.client.authenticates and (is_token_error(exc) or "permission denied" in str(exc)):
            with contextlib.suppress(*ETCD_ERRORS):
                await self.client.reauthenticate(stale)

    async def get(self, key: bytes) -> KV | None:
        got = await self._authed(lambda: self.client.get(key))
        return None if got is None else KV(got.key, got.value, got.create_revision,
                                           got.mod_revision, got.lease)

    async def get_prefix(self, prefix: bytes) -> tuple[list[KV], int]:
        """All keys under `prefix` and the revision they were read at."""
        request = rpc.RangeRequest(key=prefix, range_end=aetcd.utils.prefix_range_end(prefix))

        async def call() -> Any:
            await self.client.connect()
            return await rpc.KVStub(self.channel).Range(request, timeout=self.timeout,
                                                        metadata=self.metadata)
        resp = await self._authed(call)
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        resp = await self._authed(lambda: self.client.put(key, value, lease=lease or None))
        return resp.header.revision

    async def delete(self, key: bytes) -> bool:
        return bool(await self._authed(lambda: self.client.delete(key)))

    async def txn(self, compare: list[Any], success: list[Any],
                  failure: list[Any] | None = None) -> tuple[bool, list[Any]]:
        return await self._authed(lambda: self.client.transaction(
            compare=compare, success=success, failure=failure or []))

    async def grant(self, ttl: int) -> int:
        return (await self._authed(lambda: self.client.lease(ttl))).id

    async def revoke(self, lease_id: int) -> None:
        await self._authed(lambda: self.client.revoke_lease(lease_id))

    async def watch(self, key: bytes, *, prefix: bool = False, start_revision: int = 0,
                    progress_every: float | None = None) -> AsyncIterator[Any]:
        """Raw WatchResponses from `start_revision` (0: from now) until the stream breaks.

        With `progress_every`, a progress request is sent that often; etcd answers it (an
        empty response whose header revision is current) only once the watcher has caught up
        with history, which is how a reader of history knows it has seen all of it.
        """
        await self.client.connect()
        create = rpc.WatchCreateRequest(key=key, start_revision=start_revision, prev_kv=True)
        if prefix:
            create.range_end = aetcd.utils.prefix_range_end(key)
        stop = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield rpc.WatchRequest(create_request=create)
            while progress_every is not None and not stop.is_set():
                await asyncio.sleep(progress_every)
                yield rpc.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest())
            await stop.wait()

        stale, channel = self.metadata, self.channel
        call = rpc.WatchStub(channel).Watch(requests(), metadata=stale)
        try:
            async for resp in call:
                if resp.compact_revision:
                    raise WatchCompacted(resp.compact_revision)
                if resp.canceled:
                    raise ConnectionError(f"etcd cancelled the watch: {resp.cancel_reason}")
                yield resp
        except ETCD_ERRORS as exc:
            await self._on_stream_error(exc, stale, channel)
            raise
        finally:
            stop.set()
            call.cancel()


class KeepAlive:
    """One long-lived LeaseKeepAlive stream for one lease, reopened after stream errors.

    `deadline` is when the lease may have expired in etcd: the *send* time of the last
    acknowledged keepalive plus the TTL (etcd refreshed it no earlier than we sent it), so an
    agent that fences itself at `deadline` is never still acting after etcd expired it.
    """

    def __init__(self, etcd: Etcd, lease_id: int, ttl: int) -> None:
        self.etcd = etcd
        self.lease_id = lease_id
        self.ttl = ttl
        self.deadline = time.monotonic() + ttl
        self.expired = asyncio.Event()

    async def run(self) -> None:
        while not self.expired.is_set():
            with contextlib.suppress(ETCD_ERRORS):
                await self._stream()
            await asyncio.sleep(min(0.2, self.ttl / 10))

    async def _stream(self) -> None:
        sent: collections.deque[float] = collections.deque()
        interval = self.ttl / 3

        async def requests() -> AsyncIterator[Any]:
            while True:
                sent.append(time.monotonic())
                yield rpc.LeaseKeepAliveRequest(ID=self.lease_id)
                await asyncio.sleep(interval)

        await self.etcd.client.connect()
        stale, channel = self.etcd.metadata, self.etcd.channel
        call = rpc.LeaseStub(channel).LeaseKeepAlive(requests(), metadata=stale)
        try:
            async for resp in call:
                at = sent.popleft() if sent else time.monotonic() - interval
                if resp.TTL <= 0:
                    self.expired.set()
                    return
                self.deadline = max(self.deadline, at + self.ttl)
        except ETCD_ERRORS as exc:
            await self.etcd._on_stream_error(exc, stale, channel)
            raise
        finally:
            call.cancel()
