"""Run the trainer as users do (torchrun, or a plain process) and collect its JSON step lines."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, worker_env
from tests.forkserver import forkserver


@dataclass(frozen=True)
class RunResult:
    returncode: int
    steps: dict[int, dict]
    stderr: str


def run_trainer(config: Path, nproc: int | None, *args: str, timeout: float = 300,
                launcher: str = "fork") -> RunResult:
    """nproc=None runs `python -m trainer` directly (a world of one, no launcher).

    `launcher`: "torchrun" (`torchrun --standalone`, as users launch it) or "fork"
    (tests/forkrun.py: the same rank environment, with one import of torch for all ranks,
    and that one done once per pytest process: the launcher is forked from the tests'
    forkserver, tests/forkserver.py)."""
    if launcher not in ("fork", "torchrun"):
        raise ValueError(f"launcher must be fork or torchrun, not {launcher!r}")
    trainer_args = ["--config", str(config), "--log-format", "json", *args]
    if nproc is not None and launcher == "fork":
        returncode, stdout, stderr = _forked_launch(nproc, trainer_args, timeout)
    else:
        launcher_args = ([] if nproc is None else
                         ["-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={nproc}"])
        proc = subprocess.run([sys.executable, *launcher_args, "-m", "trainer", *trainer_args],
                              cwd=REPO, env=worker_env(), capture_output=True, text=True,
                              timeout=timeout)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    steps = {}
    for line in stdout.splitlines():
        rec = json.loads(line)  # stdout carries nothing but step records
        steps[rec["step"]] = rec
    return RunResult(returncode, steps, stderr)


def _forked_launch(nproc: int, argv: list[str], timeout: float) -> tuple[int, str, str]:
    """`python -m tests.forkrun --nproc-per-node N -m trainer ARGV` without its interpreter start:
    (exit code, stdout, stderr); a launch past `timeout` is killed with its ranks and raises
    `subprocess.TimeoutExpired`, as `subprocess.run` does."""
    from tests.forkrun import launch_captured  # torch and the trainer: only where they run

    context = multiprocessing.get_context(forkserver())
    with tempfile.TemporaryDirectory(prefix="forkrun-out-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = context.Process(target=launch_captured,
                               args=(nproc, argv, worker_env(), str(REPO), str(out), str(err)))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: it and its ranks
            proc.kill()  # had it not made its session yet, its ranks die with it
            proc.join()
            raise subprocess.TimeoutExpired([*argv], timeout, _text(out), _text(err))
        return proc.exitcode, _text(out), _text(err)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def checkpoint_state(ckpt_dir: Path, tmp: Path) -> dict:
    """A DCP checkpoint's whole training state, gathered into one dict without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt_dir.name}.pt"
    dcp_to_torch_save(ckpt_dir, out)
    return torch.load(out, weights_only=False)["state"]


def final_model_state(ckpt_dir: Path, tmp: Path) -> dict:
    """Model tensors of a DCP checkpoint."""
    return checkpoint_state(ckpt_dir, tmp)["model"]
