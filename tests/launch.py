"""Run the trainer as users do (torchrun, or a plain process) and collect its JSON step lines."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, worker_env


@dataclass(frozen=True)
class RunResult:
    returncode: int
    steps: dict[int, dict]
    stderr: str


def run_trainer(config: Path, nproc: int | None, *args: str, timeout: float = 300,
                launcher: str = "fork") -> RunResult:
    """nproc=None runs `python -m trainer` directly (a world of one, no launcher).

    `launcher`: "torchrun" (`torchrun --standalone`, as users launch it) or "fork"
    (tests/forkrun.py: the same rank environment, with one import of torch for all ranks)."""
    if launcher not in ("fork", "torchrun"):
        raise ValueError(f"launcher must be fork or torchrun, not {launcher!r}")
    launcher_args = (
        []
        if nproc is None
        else ["-m", "tests.forkrun", f"--nproc-per-node={nproc}"]
        if launcher == "fork"
        else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    )
    cmd = [
        sys.executable,
        *launcher_args,
        "-m",
        "trainer",
        "--config",
        str(config),
        "--log-format",
        "json",
        *args,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout
    )
    steps = {}
    for line in proc.stdout.splitlines():
        rec = json.loads(line)  # stdout carries nothing but step records
        steps[rec["step"]] = rec
    return RunResult(proc.returncode, steps, proc.stderr)


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
