"""The snapshot store as real processes keep it (docs/snapshots.md, "Where snapshots live"): an
agent refuses a base another user owns before it writes anything, and `ultrad local` leaves
nothing in shared memory after a SIGTERM or Ctrl-C, nor (from its next start on) after a
SIGKILL. Real etcd, agents and workers."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.control.etcd_server import EtcdServer
from daemon.procutil import terminate
from tests.integration.conftest import ROOT, wait_until
from tests.processes import Held, descendants

pytestmark = pytest.mark.integration

NOBODY = 65534  # nobody:nogroup
SECRET = b"root only: nothing may write here\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user owns needs root")
def test_an_agent_refuses_a_snapshot_base_another_user_owns(tmp_path: Path, etcd: EtcdServer):
    secret = tmp_path / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, SECRET)
    os.close(fd)
    base = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ultrascale-test-"))
    try:
        # Another user's base, private to them, with links where the agent's node would write.
        planted = base / "test" / "node-0" / "step_00000001"
        planted.mkdir(parents=True)
        for name in ("manifest.json", "manifest.json.tmp", "rank_00000.json.tmp"):
            (planted / name).symlink_to(secret)
        for directory, dirnames, filenames in os.walk(base):
            for name in dirnames + filenames:
                os.chown(os.path.join(directory, name), NOBODY, NOBODY, follow_symlinks=False)
        os.chown(base, NOBODY, NOBODY)
        token = tmp_path / "token"
        token.write_text("test-token\n")
        token.chmod(0o600)
        log = tmp_path / "ultrad.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.cli.ultrad", "--etcd", etcd.endpoint,
                 "--node-id", "node-0", "--devices", "1", "--listen", "127.0.0.1:0",
                 "--metrics-listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                 "--token-file", str(token), "--ttl", "2", "--job", "test",
                 "--no-standby-worker", "--snapshot-dir", str(base)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            terminate(proc)
        text = log.read_text(errors="replace")
        assert code == 1, f"the agent ran with another user's snapshot base:\n{text[-2000:]}"
        assert f"snapshot directory {base} is owned by uid {NOBODY}" in text, text[-2000:]
        assert secret.read_bytes() == SECRET
        assert all((planted / n).is_symlink() for n in ("manifest.json", "manifest.json.tmp"))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _snapshot_dir(proc: subprocess.Popen[bytes], shm: Path | None) -> Path | None:
    """The `--snapshot-dir` `ultrad local` gave its agent, once the agent is up, as this process
    sees it (under `shm` where /dev/shm was `shm` for the agent)."""
    for pid in descendants(proc.pid):
        with contextlib.suppress(OSError):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"daemon.cli.ultrad" in args and b"--snapshot-dir" in args:
                path = Path(os.fsdecode(args[args.index(b"--snapshot-dir") + 1]))
                return path if shm is None else shm / path.relative_to("/dev/shm")
    return None


def _has_a_step(snapshots: Path) -> bool:
    return any(d.startswith("step_") for _, dirs, _ in os.walk(snapshots) for d in dirs)


@pytest.fixture
def made() -> Iterator[list[Path]]:
    """Snapshot directories of the `ultrad local` runs of a test, removed at its end."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def private_shm() -> Iterator[Path]:
    """A directory that `ultrad_local(..., shm=)` mounts over /dev/shm for its processes: the
    local clusters that other tests start at the same time (each start removes the snapshot
    directories of killed ones) never see what is in it."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace: {probe.stderr}")
    parent = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(dir=parent, prefix="ultrascale-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def ultrad_local(tmp_path: Path, name: str, made: list[Path], shm: Path | None = None
                 ) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`ultrad local examples/tiny.toml` on one node, long enough to outlive the test, and its
    snapshot directory once its agent runs; whatever of it is left at the end is killed. With
    `shm`, it runs in a mount namespace of its own where /dev/shm is `shm`."""
    state = tmp_path / name
    state.mkdir()
    private = [] if shm is None else [
        "unshare", "--mount", "--propagation", "private", "sh", "-c",
        f'mount --bind "{shm}" /dev/shm && exec "$0" "$@"']
    with (state / "local.log").open("wb") as out:
        proc = subprocess.Popen(
            [*private, sys.executable, "-m", "daemon.cli.ultrad", "local",
             str(ROOT / "examples/tiny.toml"), "--nodes", "1", "--devices-per-node", "1",
             "--ttl", "2", "--state-dir", str(state), "--set", "train.steps=100000"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(tmp_path)})
    seen = Held()
    try:
        wait_until(lambda: _snapshot_dir(proc, shm) or proc.poll() is not None, 120,
                   f"ultrad local's agent ({state})")
        snapshots = _snapshot_dir(proc, shm)
        assert proc.poll() is None and snapshots, (state / "local.log").read_text()
        made.append(snapshots)
        seen.add(descendants(proc.pid))
        yield proc, snapshots
    finally:
        seen.add(descendants(proc.pid))
        proc.kill()
        seen.kill()
        seen.close()
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_ultrad_local_stopped_by_a_signal_leaves_no_snapshot_and_no_process(tmp_path, made, sig):
    with ultrad_local(tmp_path, "local", made) as (proc, snapshots):
        wait_until(lambda: _has_a_step(snapshots) or proc.poll() is not None, 300,
                   "a first snapshot")
        family = Held(descendants(proc.pid))
        assert proc.poll() is None and family.pids, "ultrad local ended before the test stopped it"
        os.kill(proc.pid, sig)
        code = proc.wait(120)
        assert not snapshots.exists(), f"{snapshots} left behind (exit {code})"
        wait_until(lambda: not family.running(), 30, "every process it started to end")
        family.close()
        assert code == 128 + sig


def test_the_next_ultrad_local_removes_what_a_killed_one_left(tmp_path, made, private_shm):
    with ultrad_local(tmp_path, "killed", made, private_shm) as (first, left):
        family = Held(descendants(first.pid))
        first.kill()  # nothing runs on SIGKILL: its snapshot directory stays, for now
        first.wait()
        wait_until(lambda: not family.running(), 30, "its agent and etcd to die with it")
        family.close()
        assert left.is_dir()
    with ultrad_local(tmp_path, "next", made, private_shm) as (second, mine):
        assert not left.exists(), f"{left}, of a killed ultrad local, is still there"
        second.send_signal(signal.SIGTERM)
        assert second.wait(120) == 128 + signal.SIGTERM
        assert not mine.exists()
