"""Plain `torchrun --rdzv-backend ultrascale` "nodes" on loopback, for the rendezvous tests: each
node is one torchrun process (its agent) with its workers, trained on examples/tiny.toml."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from checkpoint.manifest import checkpoint_dir
from checkpoint.manifest_format import MANIFEST_NAME
from tests.conftest import REPO, worker_env
from tests.processes import Held, descendants

RUN_ID = "tiny-torchrun"
STEPS = 6
CHECKPOINT_EVERY = 2
# Quick failure detection: a node missing 2 heartbeats 1 s apart is dropped from the rendezvous.
TIMING = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=2,join_timeout=120"


def require_entry_point() -> None:
    """torchrun finds the backend through the package's `torchrun.handlers` entry point."""
    names = {ep.name for ep in entry_points(group="torchrun.handlers")}
    if "ultrascale" not in names:
        pytest.fail("the torchrun.handlers entry point `ultrascale` is not installed: run "
                    "`make install` (pyproject.toml declares it)")


def torchrun_env() -> dict[str, str]:
    env = worker_env()
    # The tests' PYTHONPATH (if any) after the repository: it may carry the entry point.
    extra = os.environ.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), extra) if p)
    return env


@dataclass
class TorchrunNode:
    name: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def kill(self) -> None:
        """SIGKILL the agent and then its workers: the node is gone, as in a crash."""
        workers = Held(descendants(self.proc.pid))
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        workers.kill()
        workers.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()

    @property
    def log(self) -> str:
        return self.err.read_text(errors="replace")[-6000:]


@dataclass
class TorchrunJob:
    root: Path
    endpoint: str
    nnodes: str = "2"
    conf: str = TIMING
    nodes: list[TorchrunNode] = field(default_factory=list)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", self.nnodes,
                "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "ultrascale",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", RUN_ID, "--rdzv-conf", self.conf,
                "-m", "trainer", "--config", "examples/tiny.toml", "--steps", str(STEPS),
                "--resume", "--checkpoint-dir", str(self.root / "checkpoints"),
                "--checkpoint-every", str(CHECKPOINT_EVERY), "--log-format", "json",
                # examples/tiny.toml with 2 of its 8 layers: seconds per step on 2 busy cores
                "--set", "model.num_hidden_layers=2"]

    def start(self, name: str) -> TorchrunNode:
        out, err = self.root / f"{name}.out", self.root / f"{name}.err"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(self.command(), cwd=REPO, env=torchrun_env(), stdout=o,
                                    stderr=e, stdin=subprocess.DEVNULL)
        node = TorchrunNode(name, proc, out, err)
        self.nodes.append(node)
        return node

    def steps(self) -> dict[int, dict]:
        """Rank 0's step records, wherever its node's torchrun wrote them (the last record of
        each step: a step trained again after a restart replaces the first)."""
        records: dict[int, dict] = {}
        for node in self.nodes:
            for path in (node.out, node.err):
                for line in path.read_text(errors="replace").splitlines():
                    if line.startswith('{"step"'):
                        rec = json.loads(line)
                        records[rec["step"]] = rec
        return records

    def wait_for_checkpoint(self, step: int, timeout: float) -> None:
        """Until the durable checkpoint of `step` is committed: its manifest, written last (a
        later step's line does not say so: the save is asynchronous)."""
        manifest = checkpoint_dir(self.root / "checkpoints", step) / MANIFEST_NAME
        deadline = time.monotonic() + timeout
        while not manifest.exists():
            dead = [n for n in self.nodes if n.proc.poll() is not None]
            assert not dead, f"{dead[0].name} exited early:\n{dead[0].log}"
            assert time.monotonic() < deadline, (
                f"no checkpoint of step {step} in {timeout}s:\n"
                + "\n".join(f"== {n.name}\n{n.log}" for n in self.nodes))
            time.sleep(0.2)

    def wait(self, node: TorchrunNode, timeout: float) -> int:
        try:
            return node.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{node.name} still running after {timeout}s:\n"
                                 + "\n".join(f"== {n.name}\n{n.log}" for n in self.nodes)
                                 ) from None

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
