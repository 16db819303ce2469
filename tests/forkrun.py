"""`python -m tests.forkrun --nproc-per-node N -m trainer ARGS`: torchrun's standalone launch,
with one import of torch and the trainer for the whole world instead of one per rank.

The parity tests launch the trainer dozens of times with up to 8 ranks; on a 2-core machine
each rank's import of torch and the trainer (about 3 s of CPU) cost more than its training.
This launcher imports them once, then forks one process per rank with the environment torchrun
gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the
trainer joins its world through the same `env://` path (trainer/run.py). Nothing has run torch
code or started a thread before the fork. Like torchrun, when a rank fails the others are
stopped, and the exit code is the first failed rank's.

Each rank's stderr goes to a file of its own, copied to the launcher's stderr once all have
exited: rank by rank, the first rank to fail last. A test's message shows the tail of stderr,
and there the cause (a C++ abort's message, the dying rank's Python stacks) comes before the
line saying which rank went first, instead of lost under the others' "connection closed".

`tests.launch.run_trainer` uses it unless a test asks for torchrun itself (`launcher="torchrun"`:
the tests of the torchrun entry keep it).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Everything a rank imports, imported before the fork (the point of this launcher).
import trainer.cli  # noqa: F401
import trainer.run  # noqa: F401
from daemon.procutil import free_port
from trainer.agent_death import die_with_agent

GRACE_S = 10.0  # after a rank fails, how long the others have to fail on their own


def _rank(rank: int, nproc: int, port: int, argv: list[str], launcher: int, stderr: Path) -> None:
    """The child: torchrun's rank environment, then the trainer's entry; never returns."""
    die_with_agent()  # with the launcher, when a test's timeout kills it
    fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)  # for C++ (gloo's, torch's messages) as for Python's sys.stderr
    os.close(fd)
    faulthandler.enable()  # a rank killed by a fatal signal prints its Python stacks
    if os.getppid() != launcher:
        os._exit(1)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    code = 1
    try:
        code = trainer.cli.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a rank's failure is its exit code, as under torchrun
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _exit_text(rank: int, code: int, at: float) -> str:
    how = f"code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
    return f"rank {rank} {how} at {at:.2f} s"


def launch(nproc: int, argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="forkrun-") as tmp:
        stderrs = [Path(tmp) / f"rank{rank}.stderr" for rank in range(nproc)]
        code, first_failed = _run_ranks(nproc, argv, stderrs)
        for rank in sorted(range(nproc), key=lambda r: r == first_failed):  # it last
            text = stderrs[rank].read_text(errors="replace") if stderrs[rank].exists() else ""
            if text:
                sys.stderr.write(text if nproc == 1 else f"--- rank {rank} stderr ---\n{text}")
        return code


def _run_ranks(nproc: int, argv: list[str], stderrs: list[Path]) -> tuple[int, int | None]:
    """Fork the ranks and wait for them all: (the first failure's code, its rank) or (0, None)."""
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids, launcher, start = {}, os.getpid(), time.monotonic()
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(rank, nproc, port, argv, launcher, stderrs[rank])
        pids[pid] = rank
    first_failure, first_failed, deadline, exits = 0, None, None, []
    while pids:
        if deadline is not None and time.monotonic() > deadline:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        pid, status = os.waitpid(-1, os.WNOHANG if deadline is not None else 0)
        if pid == 0:
            time.sleep(0.05)
            continue
        code = os.waitstatus_to_exitcode(status)
        rank = pids.pop(pid)
        exits.append(_exit_text(rank, code, time.monotonic() - start))
        if code != 0 and first_failure == 0:
            first_failure, first_failed = (code if code > 0 else 1), rank
            deadline = time.monotonic() + GRACE_S
    if first_failure:
        # Last on the failed rank's stderr, the last copied: which rank went first, and how.
        with stderrs[first_failed].open("a") as out:
            out.write(f"forkrun: ranks exited in this order: {'; '.join(exits)}\n")
    return first_failure, first_failed


def launch_captured(nproc: int, argv: list[str], env: dict[str, str], cwd: str, stdout: str,
                    stderr: str) -> None:
    """`launch` as the body of a process forked from the tests' forkserver (tests/launch.py),
    which has imported all of this already: this process takes `env` and `cwd` as a fresh
    `python -m tests.forkrun` would, writes its stdout and stderr (its ranks' too) to the two
    files, and exits with the launch's code. Its own process group, so a timeout ends it all."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    code = 1
    try:
        code = launch(nproc, argv)
    except BaseException:  # noqa: BLE001 - the exit code and stderr say it, as for a process
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> int:
    if "-m" not in argv or argv[argv.index("-m") + 1:][:1] != ["trainer"]:
        raise SystemExit("usage: python -m tests.forkrun --nproc-per-node N -m trainer ARGS")
    at = argv.index("-m")
    ap = argparse.ArgumentParser(prog="python -m tests.forkrun")
    ap.add_argument("--nproc-per-node", type=int, required=True)
    args = ap.parse_args(argv[:at])
    return launch(args.nproc_per_node, argv[at + 2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
