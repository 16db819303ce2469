"""A checkpoint.dir that is not shared between nodes fails the job at once, naming the node.

node-1's agent (and so its worker) runs in a mount namespace of its own with a private tmpfs
over the checkpoint directory: the same path, a different filesystem, as with a node-local disk
on a real cluster. Without the check, every generation would write fragments and fail to
restore, forever.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from daemon.cli.local import LocalCluster, _call
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import small_job_text
from tests.integration.conftest import wait_for_members, wait_until
from tests.processes import running

pytestmark = pytest.mark.integration


def _can_unshare() -> str:
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"cannot create a mount namespace: {probe.stderr}"


def test_unshared_checkpoint_dir_fails_the_job_naming_the_node(tmp_path: Path,
                                                               token_file: Path) -> None:
    reason = _can_unshare()
    if reason:
        pytest.skip(reason)
    output = tmp_path / "output"
    ckpt = output / "ckpt"
    ckpt.mkdir(parents=True)
    private = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               f'mount -t tmpfs tmpfs "{ckpt}" && exec "$0" "$@"']
    with running(LocalCluster(tmp_path / "state", nodes=2, devices_per_node=1, ttl=2,
                              launch_prefix={"node-1": private})) as cluster:
        token = cluster.token_file.read_text().strip()
        wait_for_members(cluster, token, 2)  # so that the first generation has both
        job = small_job_text(token_file, train={"steps": 8},
                             checkpoint={"dir": "ckpt", "every": 2})
        _call(cluster, token, "SubmitJob",
              pb.SubmitJobRequest(spec_toml=job, overrides=[f'job.output_dir="{output}"']))

        def status() -> pb.Status:
            reply = _call(cluster, token, "GetStatus", pb.GetStatusRequest())
            assert isinstance(reply, pb.Status)
            return reply

        final = wait_until(lambda: (s := status()).state == "failed" and s, 120, "failed")
        assert "checkpoint.dir is not shared: node-1 cannot see" in final.reason, final
        assert str(ckpt) in final.reason
        assert final.world_size == 2, final
        assert final.generation == 1, "no retry: a mount is not fixed by re-forming"
