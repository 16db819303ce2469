"""`ultrad --job-file`: the job shipped with the agents (a Kubernetes ConfigMap) is stored once,
by whichever agent comes first, and never replaces a stored job."""

from __future__ import annotations

import pytest

from tests.integration.conftest import TINY_JOB, Cluster, etcd_call, wait_until

pytestmark = pytest.mark.integration


def test_job_file_is_submitted_once_and_never_replaces(cluster: Cluster) -> None:
    first = cluster.root / "job.toml"
    first.write_text(TINY_JOB)
    other = cluster.root / "other.toml"
    other.write_text(TINY_JOB.replace('name = "tiny"', 'name = "other"'))

    cluster.start("n1", 1, "--job-file", str(first))
    wait_until(lambda: cluster.status().generation >= 1, 20, "a generation from --job-file")
    assert cluster.status().job == "tiny"
    spec_key = f"/ultrascale/{cluster.job_ns}/spec".encode()
    stored = etcd_call(cluster.etcd.endpoint, lambda e: e.get(spec_key))

    # A second agent (a restart or a roll-out with an edited ConfigMap) offers another job.
    n2 = cluster.start("n2", 1, "--job-file", str(other))
    wait_until(lambda: "a job is already stored" in n2.log, 20, "n2 to offer its job file")
    assert cluster.status("n2").job == "tiny"
    again = etcd_call(cluster.etcd.endpoint, lambda e: e.get(spec_key))
    assert again.mod_revision == stored.mod_revision
