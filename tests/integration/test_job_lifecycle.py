"""`ultractl job get`, `logs`, `job cancel` and `wait` against a real `ultrad local` run (etcd,
two agents, two workers training examples/tiny.toml), driven as subprocesses as an operator
would: the cancel stops the job at a step boundary with a durable checkpoint, the job is
`cancelled`, its workers exit, and a new submission afterwards runs to the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from daemon.cli.ctlconfig import config_path, load_context, save_context
from daemon.cli.local import LocalCluster
from proto.ultrascale.v1 import agent_pb2 as pb
from proto.ultrascale.v1 import agent_pb2_grpc as pb_grpc
from tests.integration.conftest import ROOT, wait_until
from tests.processes import Held, descendants

pytestmark = pytest.mark.integration

TINY = ROOT / "examples" / "tiny.toml"


def ultractl(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real CLI, with the `local` context `ultrad local` wrote under `home`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ULTRA")}
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli.ultractl", "--context", "local", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(home)})


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip()


def workers_of(proc: subprocess.Popen[bytes]) -> list[int]:
    out = []
    for pid in descendants(proc.pid):
        with contextlib.suppress(OSError):
            if b"trainer.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return out


@pytest.fixture
def local(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`ultrad local examples/tiny.toml --nodes 2`, long enough to outlive the test (no
    periodic checkpoint: the cancel's is the only one). Its lease TTL is 6 s, not the 2 s of
    the recovery tests: this test checks what the CLI says of one uninterrupted run, and with
    2 s a loaded two-core box (both standbys importing torch while another test trains) once
    stalled an agent's keepalives that long; it fenced itself, as it must, generation 1 failed,
    and the job ended "cancelled after generation 1 failed" instead of "cancelled at step"."""
    state = tmp_path / "state"
    state.mkdir()
    with (tmp_path / "local.log").open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli.ultrad", "local", str(TINY), "--nodes", "2",
             "--devices-per-node", "1", "--ttl", "6", "--state-dir", str(state),
             "--set", "train.steps=100000", "--set", "checkpoint.every=100000"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(tmp_path)})
    try:
        yield proc, state
    finally:
        seen = Held(descendants(proc.pid))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
        proc.kill()
        seen.kill()
        seen.close()
        proc.wait()


def test_get_logs_cancel_wait_and_submit_again(local, tmp_path: Path) -> None:
    proc, state = local
    home = tmp_path
    log = tmp_path / "local.log"
    config = config_path({"XDG_CONFIG_HOME": str(home)})
    wait_until(lambda: config.exists() or proc.poll() is not None, 120,
               "ultrad local's context")
    assert proc.poll() is None, log.read_text()

    # wait: reaches running (exit 0); a timeout is exit 4 and names the state it waited for.
    running = ultractl(home, "wait", "--for=state=running", "--timeout", "300", timeout=320)
    assert running.returncode == 0, running.stderr + log.read_text()[-3000:]
    assert running.stdout.startswith("job tiny: running")
    early = ultractl(home, "wait", "--for", "state=cancelled", "--timeout", "1")
    assert early.returncode == 4, early.stderr
    assert one_line(early).startswith("ultractl: wait: timed out after 1s waiting for "
                                      "state=cancelled (job tiny is running)")

    # job get: the spec as submitted, with its overrides and revision.
    got = ultractl(home, "job", "get", "-o", "json")
    assert got.returncode == 0, got.stderr
    spec = json.loads(got.stdout)
    assert spec["job"] == "tiny" and spec["revision"] > 0 and spec["state"] == "running"
    assert spec["spec_toml"] == TINY.read_text()
    assert "train.steps=100000" in spec["overrides"]
    assert spec["config"]["train"]["steps"] == 100000
    toml = ultractl(home, "job", "get")
    assert toml.returncode == 0, toml.stderr
    assert toml.stdout.startswith(f"# job tiny, revision {spec['revision']}, submitted ")
    assert "# --set train.steps=100000\n" in toml.stdout and TINY.read_text() in toml.stdout
    yaml_out = ultractl(home, "job", "get", "-o", "yaml")
    assert yaml_out.returncode == 0 and "revision: " in yaml_out.stdout

    # logs: a worker's output through its node's agent; bad inputs are one line, exit 1.
    wait_until(lambda: any("restored" in ultractl(home, "logs", n).stdout
                           for n in ("node-0", "node-1")), 120, "rank 0's restore line")
    unknown = ultractl(home, "logs", "node-9")
    assert unknown.returncode == 1
    assert one_line(unknown) == "ultractl: logs: unknown node 'node-9' (members: node-0, node-1)"
    bad_rank = ultractl(home, "logs", "node-1", "--rank", "3")
    assert bad_rank.returncode == 1
    assert "local ranks 0..0 (got 3)" in one_line(bad_rank)
    # The RPC is an admin RPC: without the token, nothing.
    ctx = load_context(config, "local")
    with grpc.insecure_channel(ctx.endpoints()[0]) as channel:
        stream = pb_grpc.AgentStub(channel).ReadWorkerLog(
            pb.WorkerLogRequest(node="node-0"), timeout=10)
        with pytest.raises(grpc.RpcError) as denied:
            list(stream)
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ULTRA")}
    follow = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli.ultractl", "--context", "local", "logs", "node-0",
         "--tail", "1", "-f"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(home)})

    try:
        # job cancel: another job's name is refused; then the cancel itself.
        other = ultractl(home, "job", "cancel", "--job", "other")
        assert other.returncode == 1
        assert "no job named 'other' (submitted: 'tiny')" in one_line(other)
        step_before = json.loads(ultractl(home, "status", "-o", "json").stdout)["step"]
        cancel = ultractl(home, "job", "cancel", "--job", "tiny")
        assert cancel.returncode == 0, cancel.stderr
        assert "cancel requested" in cancel.stdout
        # Waiting for another end than the one reached: exit 1, naming it.
        finished = ultractl(home, "wait", "--for=state=finished", "--timeout", "300",
                            timeout=320)
        assert finished.returncode == 1, finished.stderr + log.read_text()[-3000:]
        assert one_line(finished).startswith("ultractl: wait: job tiny is cancelled, not "
                                             "finished (cancelled at step ")
        done = ultractl(home, "wait", "--for=state=cancelled", "--timeout", "5")
        assert done.returncode == 0, done.stderr
        status = json.loads(ultractl(home, "status", "-o", "json").stdout)
        assert status["state"] == "cancelled" and not status["finished"]
        stopped_at = status["step"]
        assert stopped_at >= step_before
        assert status["reason"] == (f"cancelled at step {stopped_at} (last durable checkpoint: "
                                    f"step {stopped_at})")
        table = ultractl(home, "status")
        assert "cancelled" in table.stdout
        # The agents stop its workers; ultrad local stays up for the next job.
        wait_until(lambda: not workers_of(proc), 120, "the workers to exit")
        assert proc.poll() is None
        again = ultractl(home, "job", "cancel")
        assert again.returncode == 1
        assert "has already ended (cancelled)" in one_line(again)
        time.sleep(1)  # -f polls the file: let it read what the workers wrote as they left
    finally:
        follow.send_signal(signal.SIGINT)
        followed, _ = follow.communicate(timeout=30)
    assert f"stopped at step {stopped_at}".encode() in followed, followed[-2000:]
    after = ultractl(home, "logs", "node-1", "--tail", "5")
    assert f"stopped at step {stopped_at}" in after.stdout, after.stdout
    assert len(after.stdout.splitlines()) <= 5

    # A new submission after the cancel: accepted without --replace, and it runs to the end.
    output = f"job.output_dir=\"{state / 'output'}\""
    submit = ultractl(home, "job", "submit", str(TINY), "--set", "train.steps=3",
                      "--set", output)
    assert submit.returncode == 0, submit.stderr
    # `ultrad local` stops its cluster once the job finishes, so a `wait` for `finished` could
    # find no agent left to answer: its exit is the sign here.
    assert proc.wait(400) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "ultrad local: job cancelled (cancelled at step" in text
    assert "ultrad local: job finished" in text
    # The progress lines count toward the job submitted now, not the first job's total.
    second = text.split("ultrad local: job cancelled", 1)[1]
    # (The new job resumes from the cancelled one's checkpoint: its first line may already be
    # past its 3 steps, "step 8/3".)
    assert re.search(r"step \d+/3 ", second) and "/100000" not in second, second[-2000:]


@pytest.fixture
def control_plane(tmp_path: Path) -> Iterator[Path]:
    """What `ultrad local` starts, two agents without workers; the `local` context's home."""
    cluster = LocalCluster(tmp_path / "local", nodes=2, devices_per_node=1, ttl=2,
                           extra_agent_args=["--no-workers"])
    try:
        cluster.start(timeout=120)
        save_context(config_path({"XDG_CONFIG_HOME": str(tmp_path)}), cluster.context())
        yield tmp_path
    finally:
        cluster.stop()


def test_refusals_are_one_line_with_their_exit_code(control_plane: Path) -> None:
    home = control_plane
    for argv, code, message in [
        (("job", "get"), 1, "ultractl: NOT_FOUND: no job submitted"),
        (("job", "cancel"), 1, "ultractl: FAILED_PRECONDITION: no job submitted"),
        (("logs", "node-7"), 1, "ultractl: logs: unknown node 'node-7' (members: node-0, "
                                "node-1)"),
        (("logs", "node-1"), 1, "ultractl: NOT_FOUND: node 'node-1' runs no workers"),
        (("logs", "node-1", "--tail", "0"), 2, "ultractl: logs --tail: expected lines >= 1 "
                                               "(got 0)"),
        (("wait", "--timeout", "1"), 4, "ultractl: wait: timed out after 1s waiting for "
                                        "state=finished (job - is none)"),
        (("job", "get", "-o", "xml"), 2, "ultractl: job get -o: expected one of toml, yaml, "
                                         "json (got 'xml')"),
        (("wait", "--for=state=gone"), 2, "ultractl: wait --for: expected state=STATE"),
    ]:
        result = ultractl(home, *argv)
        assert result.returncode == code, (argv, result.stderr)
        assert one_line(result).startswith(message), (argv, result.stderr)
    # An agent serves only its own node's logs, whatever a caller with the token asks.
    ctx = load_context(config_path({"XDG_CONFIG_HOME": str(home)}), "local")
    first = ctx.endpoints()[0]
    token = Path(ctx.token_file).read_text().strip()
    with grpc.insecure_channel(first) as channel:
        stub = pb_grpc.AgentStub(channel)
        answering = stub.GetStatus(pb.GetStatusRequest(), timeout=10,
                                   metadata=(("authorization", f"Bearer {token}"),)).node
        other = "node-1" if answering == "node-0" else "node-0"
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ReadWorkerLog(pb.WorkerLogRequest(node=other), timeout=10,
                                    metadata=(("authorization", f"Bearer {token}"),)))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert refused.value.details() == f"node: this agent is {answering!r}, not {other!r}"


def test_a_generation_that_never_steps_is_cancelled_without_a_checkpoint(
        control_plane: Path) -> None:
    """No workers: the plan is written but no step comes; the cancel gives the generation the
    planned-stop timeout (here 3 s), then cancels it and says no checkpoint was taken."""
    home = control_plane
    output = f"job.output_dir=\"{home / 'local' / 'output'}\""
    submit = ultractl(home, "job", "submit", str(TINY), "--set", output,
                      "--set", "fault.join_timeout_s=1", "--set", "fault.restore_timeout_s=1",
                      "--set", "fault.first_step_timeout_s=1")
    assert submit.returncode == 0, submit.stderr
    assert ultractl(home, "wait", "--for=state=running", "--timeout", "60").returncode == 0
    cancel = ultractl(home, "job", "cancel", "-o", "json")
    assert cancel.returncode == 0, cancel.stderr
    assert json.loads(cancel.stdout)["job"] == "tiny"
    done = ultractl(home, "wait", "--for=state=cancelled", "--timeout", "60")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("job tiny: cancelled (cancelled without a checkpoint: "
                                   "generation 1 did not stop at a step boundary within 3s "
                                   "(no durable checkpoint))")
    events = ultractl(home, "events", "-o", "json")
    assert '"message": "job cancelled: cancelled without a checkpoint' in events.stdout
