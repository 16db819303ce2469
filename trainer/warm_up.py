"""A standby worker's warm-up: once, in a world of its own, what a rank's first generation does.

The first model build, step, snapshot and restore in a process pay for what torch does only
once: lazy imports (FSDP, DTensor, DCP), operator and sharding-rule registration, first-call
dispatch. A survivor paid them in its first generation; a standby that takes a dead worker's
rank would pay them inside the recovery, while every other rank waits for it at the first
collective. So the standby pays them while it waits (trainer/worker.py): it trains one step of
a tiny Llama in a gloo world of one over an in-process store, snapshots it into a temporary
directory, restores that snapshot, and leaves the world the way a survivor leaves a generation
(trainer/teardown.py), so the rank it later takes starts as a survivor's would.

It changes nothing a generation reads: no environment, no file outside its temporary
directory, and the global random states (torch, numpy, random) are put back. A warm-up that
fails is logged and forgotten: the standby stays usable, only colder.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from checkpoint.snapshot_reader import load_snapshot, local_fetch
from checkpoint.snapshot_writer import save_snapshot
from models.model_config import ModelConfig
from parallel.job import JobConfig, TrainConfig
from parallel.layout import Layout
from parallel.mesh import build_mesh
from trainer.data import SampleStream
from trainer.loop import Trainer
from trainer.teardown import Teardown

# The smallest job that goes through every part a generation's start uses: FSDP over a mesh
# of one, a GQA attention block, AdamW, one step of two micro-batches.
_MODEL = ModelConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                     max_position_embeddings=16)
_TRAIN = TrainConfig(steps=1, global_batch=2, seq_len=8, seed=0, warmup_steps=0)
_LAYOUT = Layout(micro_batch=1, grad_accum=2)
_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class _RandomStates:
    torch_state: torch.Tensor
    numpy_state: object
    python_state: object

    @classmethod
    def now(cls) -> _RandomStates:
        return cls(torch.get_rng_state(), np.random.get_state(), random.getstate())

    def restore(self) -> None:
        torch.set_rng_state(self.torch_state)
        np.random.set_state(self.numpy_state)  # type: ignore[arg-type]
        random.setstate(self.python_state)  # type: ignore[arg-type]


def _one_generation(directory: Path) -> None:
    job = JobConfig(model=_MODEL, train=_TRAIN)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=_TIMEOUT)
    mesh = build_mesh(_LAYOUT, "cpu", _TIMEOUT)
    tokens = np.arange(4 * _TRAIN.seq_len * _TRAIN.global_batch, dtype=np.uint16) % 64
    trainer = Trainer(job, _LAYOUT, mesh, torch.device("cpu"),
                      stream=SampleStream(tokens, _TRAIN.seq_len, _TRAIN.seed))
    step = trainer.train_step().step
    save_snapshot(trainer.state, directory, layout=_LAYOUT.to_dict())
    load_snapshot(trainer.state, step, local_fetch(directory, step))


def warm_up(teardown: Teardown, log: Callable[[str], None]) -> float:
    """Run the warm-up and leave its world through `teardown`; the seconds it took. Call it
    only while no process group exists (a standby, before it takes a rank)."""
    started = time.perf_counter()
    states = _RandomStates.now()
    try:
        with tempfile.TemporaryDirectory(prefix="ultra-warm-up-") as directory:
            _one_generation(Path(directory))
    except Exception as exc:  # noqa: BLE001 - a colder standby is still a standby
        log(f"standby: the warm-up failed ({type(exc).__name__}: {exc}); carrying on without")
    finally:
        teardown.leave()
        teardown.release()
        states.restore()
    return time.perf_counter() - started
