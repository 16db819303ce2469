"""A job's paths stay under the roots its agents allow (`allowed_paths`).

At submit (SubmitJob, `ultractl job submit`, `ultrad --job-file`) a spec whose checkpoint.dir,
job.output_dir, data.path or data.cache_dir resolves outside every allowed root, through an
absolute path, a `..` or a symlink, is refused naming the field and the roots; and an agent
refuses a spec written into etcd directly before its workers see it: the job fails naming the
field, and nothing is created there.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from daemon.cli.local import LocalCluster, _call
from daemon.control.keys import Keys
from daemon.control.records import JobSpec
from parallel import job as jobmod
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.conftest import small_job_text
from tests.integration.conftest import ROOT, Cluster, etcd_call, wait_until
from tests.processes import running

pytestmark = pytest.mark.integration

BASE = '[train]\nglobal_batch = 8\n'
SOURCE = '[data]\nsource = "python-stdlib"\n'


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    """(an allowed root holding a symlink `link` to the outside, a directory outside it)."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    (allowed / "link").symlink_to(outside, target_is_directory=True)
    return allowed, outside


def _cases(allowed: Path, outside: Path) -> list[tuple[str, str]]:
    """(spec, the field its refusal must name)."""
    return [
        (SOURCE + '[checkpoint]\ndir = "/etc/x"\n', "checkpoint.dir"),
        (SOURCE + f'[job]\noutput_dir = "{outside}"\n', "job.output_dir"),
        (f'[data]\npath = "{outside / "tokens.bin"}"\n', "data.path"),
        (SOURCE + f'cache_dir = "{outside}"\n', "data.cache_dir"),
        (SOURCE + f'[job]\noutput_dir = "{allowed}/run/../../outside"\n', "job.output_dir"),
        (SOURCE + f'[job]\noutput_dir = "{allowed}/link/run"\n', "job.output_dir"),
        (SOURCE + f'[job]\noutput_dir = "{allowed}/run"\n[checkpoint]\ndir = "../../outside"\n',
         "checkpoint.dir"),
    ]


def _spec(body: str) -> str:
    return BASE + body


def test_submit_refuses_paths_outside_the_allowed_roots(cluster: Cluster,
                                                        roots: tuple[Path, Path]) -> None:
    allowed, outside = roots
    cluster.start("n1", 1, env={"ULTRA_ALLOWED_PATHS": str(allowed)})
    for body, field in _cases(allowed, outside):
        with pytest.raises(grpc.RpcError) as err:
            cluster.submit(_spec(body))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (body, err.value)
        assert field in err.value.details() and str(allowed) in err.value.details(), \
            (body, err.value.details())
    assert cluster.status().job == ""  # nothing was stored

    ctl_spec = cluster.root / "outside.toml"
    ctl_spec.write_text(_spec(_cases(allowed, outside)[1][0]))
    refused = cluster.ctl("job", "submit", str(ctl_spec))
    assert refused.returncode != 0 and "job.output_dir" in refused.stderr, refused

    reply = cluster.submit(_spec(SOURCE + f'[job]\noutput_dir = "{allowed}/run"\n'
                                 '[checkpoint]\ndir = "ckpt"\nevery = 2\n'))
    assert reply.job == "job"
    assert not outside.exists() and not Path("/etc/x").exists()


def test_default_allows_the_state_dir_only(cluster: Cluster, roots: tuple[Path, Path]) -> None:
    allowed, _ = roots
    agent = cluster.start("n1", 1, env={"ULTRA_ALLOWED_PATHS": ""})
    with pytest.raises(grpc.RpcError) as err:
        cluster.submit(_spec(SOURCE + f'[job]\noutput_dir = "{allowed}/run"\n'))
    assert "job.output_dir" in err.value.details() and str(agent.state_dir) in err.value.details()
    assert cluster.submit(_spec(SOURCE + f'[job]\noutput_dir = "{agent.state_dir}/run"\n'))


def test_job_file_outside_the_roots_is_a_usage_error(etcd, tmp_path: Path,
                                                     roots: tuple[Path, Path]) -> None:
    allowed, outside = roots
    job = tmp_path / "job.toml"
    job.write_text(_spec(SOURCE + f'[checkpoint]\ndir = "{outside}"\n'))
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli.ultrad", "--etcd", etcd.endpoint, "--devices", "1",
         "--state-dir", str(tmp_path / "state"), "--allowed-paths", str(allowed),
         "--job-file", str(job), "--no-workers"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert f"--job-file {job}" in proc.stderr and "checkpoint.dir" in proc.stderr


def test_agent_refuses_a_spec_written_into_etcd_directly(tmp_path: Path, token_file: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever writes etcd bypasses SubmitJob: the agent checks again before its workers run."""
    output, outside = tmp_path / "output", tmp_path / "outside"
    monkeypatch.setenv("ULTRA_ALLOWED_PATHS", f"{output}:{token_file.parent}")
    text = small_job_text(token_file, train={"steps": 4},
                          checkpoint={"dir": str(outside / "ckpt"), "every": 1})
    job = jobmod.loads(text, [f'job.output_dir="{output}"'])
    spec = JobSpec(config=job.to_dict(), toml=text, submitted_at=time.time())
    with running(LocalCluster(tmp_path / "state", nodes=1, devices_per_node=1, ttl=2)) as c:
        assert c.etcd is not None
        token = c.token_file.read_text().strip()
        etcd_call(c.etcd.endpoint, lambda e: e.put(Keys(c.namespace).spec, spec.to_json()))

        def status() -> pb.Status:
            reply = _call(c, token, "GetStatus", pb.GetStatusRequest())
            assert isinstance(reply, pb.Status)
            return reply

        final = wait_until(lambda: (s := status()).state in ("failed", "finished") and s, 120,
                           "the job to end")
        assert final.state == "failed", final
        assert "checkpoint.dir" in final.reason and str(outside) in final.reason, final
        assert final.step == 0, final
    assert not outside.exists()


def test_ultrad_local_exits_2_on_a_deeply_nested_spec(tmp_path: Path) -> None:
    job = tmp_path / "deep.toml"
    job.write_text(SOURCE + "x = " + "[" * 10_000 + "]" * 10_000 + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli.ultrad", "local", str(job), "--nodes", "1",
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert str(job) in proc.stderr and "nested deeper than" in proc.stderr
    assert "Traceback" not in proc.stderr
