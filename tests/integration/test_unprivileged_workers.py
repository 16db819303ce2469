"""Least privilege: an agent started as an unprivileged user runs every process of its own
(etcd of `ultrad local`, agents, workers) as that user, never root, and the job finishes.

`ultrad local` is started through `setpriv` as `nobody` in a directory only `nobody` may write
(the situation of deploy/systemd/ultrad.service, which runs ultrad as user `ultrascale`);
every descendant's real, effective, saved and filesystem uid and gid are read from
/proc/<pid>/status while the job trains.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.procutil import parent_death_env, terminate
from tests.integration.conftest import ROOT, wait_until
from tests.processes import descendants, worker_pids

pytestmark = pytest.mark.integration

JOB = """
[job]
name = "unprivileged"
[model]
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 256
max_position_embeddings = 128
[data]
source = "python-stdlib"
[train]
steps = 20
global_batch = 4
seq_len = 64
[parallel]
dp = "auto"
micro_batch = 2
[checkpoint]
dir = "checkpoints"
every = 10
"""
DEVICES = 2


def _ids(pid: int) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
    """(uids, gids, supplementary groups) of a process, or None once it is gone or while it
    is still the `setpriv` that starts the agent."""
    try:
        fields = dict(line.split(":", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines())
    except OSError:
        return None
    if fields["Name"].strip() == "setpriv":
        return None  # the launcher itself, not yet changed to the user it execs as
    return (tuple(int(u) for u in fields["Uid"].split()),
            tuple(int(g) for g in fields["Gid"].split()), fields["Groups"].strip())


@pytest.fixture
def nobody_dir() -> Iterator[tuple[Path, int, int, tuple[str, ...]]]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to start the agent as another user")
    user = pwd.getpwnam("nobody")
    # The agent starts its workers with this same Python, as that user. Where a directory on
    # its path is closed to others (an interpreter under root's 0700 home), the user is given
    # CAP_DAC_READ_SEARCH alone, as an ambient capability its children keep: it may then read
    # that interpreter, and every uid and gid is still that user's, which is what is tested.
    caps: tuple[str, ...] = ()
    for caps in ((), ("--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search")):
        probe = subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                                "--clear-groups", *caps, "--", "/bin/sh", "-c",
                                f'exec "{sys.executable}" -c pass'],
                               capture_output=True, timeout=60)
        if probe.returncode == 0:
            break
    else:
        pytest.skip(f"user nobody cannot run {sys.executable}, even with CAP_DAC_READ_SEARCH: "
                    f"{probe.stderr.decode(errors='replace').strip()}")
    # Not under pytest's tmp_path: its parent is root's 0700 directory.
    base = Path(tempfile.mkdtemp(prefix="ultrascale-unprivileged-"))
    os.chown(base, user.pw_uid, user.pw_gid)
    base.chmod(0o700)
    shm_before = set(Path("/dev/shm").glob("ultrascale*"))
    try:
        yield base, user.pw_uid, user.pw_gid, caps
    finally:
        shutil.rmtree(base, ignore_errors=True)
        for leftover in set(Path("/dev/shm").glob("ultrascale*")) - shm_before:
            if leftover.stat().st_uid == user.pw_uid:
                shutil.rmtree(leftover, ignore_errors=True)


def test_every_process_of_an_unprivileged_agent_runs_as_its_user(
        nobody_dir: tuple[Path, int, int, tuple[str, ...]]) -> None:
    base, uid, gid, caps = nobody_dir
    (base / "job.toml").write_text(JOB)
    (base / "job.toml").chmod(0o644)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "HOME": str(base),
           "XDG_CONFIG_HOME": str(base / "config"), "TMPDIR": str(base),
           **parent_death_env()}
    log = (base / "local.log").open("wb")
    proc = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *caps, "--",
         sys.executable, "-m", "daemon.cli.ultrad", "local", str(base / "job.toml"),
         "--nodes", "1", "--devices-per-node", str(DEVICES), "--state-dir", str(base / "state")],
        cwd=base, env=env, stdout=log, stderr=subprocess.STDOUT)
    seen: dict[int, tuple[tuple[int, ...], tuple[int, ...], str]] = {}
    workers: set[int] = set()

    def observe() -> bool:
        for pid in [proc.pid, *descendants(proc.pid)]:
            ids = _ids(pid)
            if ids is not None and pid == proc.pid:
                seen[pid] = ids  # until Popen's fork has exec'd setpriv, it is root pytest
            elif ids is not None:
                seen.setdefault(pid, ids)
        for agent in descendants(proc.pid):
            workers.update(worker_pids(agent))
        return proc.poll() is not None

    try:
        wait_until(observe, 600, "the unprivileged job to end", interval=0.2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # `ultrad local` stops all it started
        terminate(proc, timeout=30)
        log.close()
    output = (base / "local.log").read_text(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    assert len(workers) >= DEVICES, f"saw workers {workers} of {sorted(seen)}"
    assert set(workers) <= set(seen)
    wrong = {pid: ids for pid, ids in seen.items()
             if ids[0] != (uid,) * 4 or ids[1] != (gid,) * 4 or ids[2]}
    assert not wrong, f"processes not running as {uid}:{gid} alone: {wrong}"
