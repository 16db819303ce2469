"""Admin authentication (bearer token) and the listen-address policy.

The token is given (--token-file) or generated into the state dir, 0600, on first start; every
Agent RPC must carry `authorization: Bearer <token>`. A token file that group or others may
read, or that another user owns, is refused. Health and reflection stay open so probes and
grpcurl work without a secret. Listening beyond loopback without TLS is refused unless the
operator says --insecure, because the token would cross the network in clear text. /metrics is
not held to that rule: it serves no secret and takes no input (docs/security.md).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from daemon.secret_files import SecretFileError, read_secret

TOKEN_FILE = "token"
_OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class AuthError(ValueError):
    pass


def load_or_create_token(token_file: Path | None, state_dir: Path) -> tuple[str, Path]:
    """The admin token and the file it lives in."""
    try:
        if token_file is not None:
            return read_secret(token_file, "--token-file", os.geteuid()), token_file
        path = state_dir / TOKEN_FILE
        if path.exists():
            return read_secret(path, "token file", os.geteuid()), path
    except SecretFileError as exc:
        raise AuthError(str(exc)) from None
    state_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL + 0600 at creation: the secret is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


def split_host_port(address: str, flag: str = "") -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{flag + ': ' if flag else ''}expected host:port, port in [0, 65535] "
                         f"(got {address!r})")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen(address: str, *, tls: bool, insecure: bool, flag: str = "--listen") -> None:
    if address.startswith("unix:"):
        return
    host, _ = split_host_port(address, flag)
    if not is_loopback(host) and not tls and not insecure:
        raise AuthError(
            f"{flag} {address} is not a loopback address and no TLS certificate is configured; "
            "configure --tls-cert/--tls-key or pass --insecure to accept clear-text traffic"
        )


PEER_SERVICE = "/ultrascale.v1.SnapshotPeer/"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """The admin token for the Agent service; the job's peer secret (read from etcd, the same
    on every agent) for agent-to-agent snapshot calls, so admin tokens can stay per node."""

    def __init__(self, token: str, peer_secret: Callable[[], str] = lambda: "") -> None:
        self._expected = f"Bearer {token}".encode()
        self._peer_secret = peer_secret

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(_OPEN_SERVICES):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        given_b = given.encode() if isinstance(given, str) else bytes(given)
        expected = self._expected
        if details.method.startswith(PEER_SERVICE):
            secret = self._peer_secret()
            if not secret:
                return _deny(await continuation(details), "this agent has no peer secret yet")
            expected = f"Bearer {secret}".encode()
        if hmac.compare_digest(given_b, expected):
            return await continuation(details)
        return _deny(await continuation(details), "missing or wrong bearer token" if given
                     else "missing bearer token (authorization metadata)")


def _deny(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    async def unary(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as the method expects

    if handler is not None and handler.response_streaming:
        streams = grpc.stream_stream_rpc_method_handler if handler.request_streaming \
            else grpc.unary_stream_rpc_method_handler
        return streams(stream, request_deserializer=handler.request_deserializer)
    deserializer = handler.request_deserializer if handler is not None else None
    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=deserializer)


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)
