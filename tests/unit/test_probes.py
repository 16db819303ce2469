"""The probe service over a real gRPC server: liveness follows the agent's supervised tasks,
unknown services are NOT_FOUND, and a bad --health-listen is a usage error naming the flag."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from daemon.api.probes import LIVENESS, READINESS, agent_probes, start_probe_server
from daemon.cli.ultrad import UsageError, _parser, build_config, resolve_options
from daemon.tasks import TaskSupervisor

pytestmark = pytest.mark.unit

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _status(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(reply.status)


def test_liveness_fails_when_a_supervised_task_dies() -> None:
    async def go() -> None:
        tasks = TaskSupervisor()
        # What the probes read of the agent; no lease yet: not ready.
        probes = agent_probes("n1", SimpleNamespace(plan=None), tasks, asyncio.Event(),
                              lambda: False)
        server, address = await start_probe_server("127.0.0.1:0", probes)
        try:
            assert await _status(address, LIVENESS) == SERVING
            assert await _status(address, "") == SERVING
            assert await _status(address, READINESS) == NOT_SERVING

            async def crash() -> None:
                raise RuntimeError("boom")

            tasks.spawn(crash(), "crasher")
            await asyncio.wait_for(tasks.failed.wait(), 10)
            assert await _status(address, LIVENESS) == NOT_SERVING
            assert await _status(address, "") == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await _status(address, "etcd")
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await tasks.close()
            await server.stop(0)

    asyncio.run(go())


@pytest.mark.parametrize("address", ["no-port", "host:http", ""])
def test_bad_health_listen_names_the_flag(address: str, tmp_path) -> None:
    argv = ["--etcd", "http://127.0.0.1:2379", "--devices", "1", "--state-dir", str(tmp_path),
            "--health-listen", address]
    opts = resolve_options(_parser().parse_args(argv), {})
    if not address:
        assert build_config(opts).health_listen == ""  # empty: off
        return
    with pytest.raises(UsageError, match="--health-listen"):
        build_config(opts)


def test_bad_job_file_names_the_flag_and_the_field(tmp_path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[train]\nglobal_batch = "eight"\n')
    base = ["--etcd", "http://127.0.0.1:2379", "--devices", "1", "--state-dir", str(tmp_path)]
    for path, expected in ((job, r"--job-file .*train\.global_batch"),
                           (tmp_path / "missing.toml", r"--job-file .*missing\.toml")):
        opts = resolve_options(_parser().parse_args([*base, "--job-file", str(path)]), {})
        with pytest.raises(UsageError, match=expected):
            build_config(opts)
