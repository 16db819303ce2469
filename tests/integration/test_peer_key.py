"""The job submission's peer key in a real etcd (daemon/control/peer_key.py): outside the job
prefix observers read, the same on every agent, replaced with each submission, and a
SnapshotPeer call with the previous submission's key is refused."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from daemon.api.auth import BearerTokenInterceptor
from daemon.api.grpc_limits import MESSAGE_OPTIONS
from daemon.api.snapshot_service import SnapshotPeerService
from daemon.control.etcd_client import Etcd
from daemon.control.etcd_server import EtcdServer
from daemon.control.keys import Keys
from daemon.control.peer_key import PeerKey, PeerKeys
from daemon.control.view import ClusterView
from daemon.node.snapshot_keeper import SnapshotKeeper
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration
KEYS = Keys("keyed")


@contextlib.asynccontextmanager
async def agent_keys(endpoint: str) -> AsyncIterator[PeerKeys]:
    """An agent's view and peer key follower on its own etcd client, running."""
    etcd = Etcd(endpoint, timeout=2)
    view = ClusterView(etcd, KEYS)
    keys = PeerKeys(etcd, KEYS, view)
    tasks = [asyncio.create_task(view.run()), asyncio.create_task(keys.run())]
    try:
        yield keys
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await etcd.close()


async def until(predicate, what: str, timeout: float = 20.0):
    async with asyncio.timeout(timeout):
        while not (value := predicate()):
            await asyncio.sleep(0.02)
    assert value, what
    return value


async def holdings_call(address: str, secret: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address, MESSAGE_OPTIONS) as channel:
        try:
            await pb_grpc.SnapshotPeerStub(channel).Holdings(
                pb.HoldingsRequest(), metadata=(("authorization", f"Bearer {secret}"),),
                timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_the_peer_key_is_private_shared_and_replaced_with_each_submission(etcd: EtcdServer,
                                                                          tmp_path):
    async def main() -> None:
        client = Etcd(etcd.endpoint, timeout=2)
        async with agent_keys(etcd.endpoint) as a, agent_keys(etcd.endpoint) as b:
            keeper = SnapshotKeeper(tmp_path / "b", "b", "", b.view, None, None,  # type: ignore[arg-type]
                                    None, lambda: 0, peer_key=b.current)
            server = grpc.aio.server(interceptors=[BearerTokenInterceptor("admin", b.secret)],
                                     options=MESSAGE_OPTIONS)
            pb_grpc.add_SnapshotPeerServicer_to_server(SnapshotPeerService(keeper), server)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            try:
                await asyncio.sleep(0.5)
                assert a.current() is None and b.current() is None  # no job: no key
                assert await holdings_call(address, "") == grpc.StatusCode.UNAUTHENTICATED

                first_revision = await client.put(KEYS.spec, b"{}")
                first = await until(lambda: a.current(), "a's key")
                assert await until(lambda: b.current(), "b's key") == first
                assert first.spec_revision == first_revision
                stored = await client.get(KEYS.peer_key)
                assert stored is not None and PeerKey.from_json(stored.value) == first
                assert stored.key.startswith(b"/ultrascale-private/keyed/")
                job_prefix, _ = await client.get_prefix(KEYS.prefix)
                assert not [kv.key for kv in job_prefix if first.secret.encode() in kv.value]
                assert await holdings_call(address, first.secret) == grpc.StatusCode.OK

                second_revision = await client.put(KEYS.spec, b'{"again": true}')
                second = await until(
                    lambda: (k := a.current()) is not None and k.spec_revision ==
                    second_revision and k, "a's key of the second submission")
                assert await until(lambda: b.current(), "b's second key") == second
                assert second.secret != first.secret
                assert await holdings_call(address, first.secret) == \
                    grpc.StatusCode.UNAUTHENTICATED
                assert await holdings_call(address, second.secret) == grpc.StatusCode.OK
            finally:
                await server.stop(None)
        await client.close()

    asyncio.run(main())
