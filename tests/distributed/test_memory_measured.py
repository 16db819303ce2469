"""Measured memory per kind (trainer/memory_meter.py) against the memory model's prediction.

Model state must match exactly: the model describes how this code base shards each tensor (TP,
then ZeRO over dp x cp with torch.chunk's uneven pieces). Activations within 10 %.
Rank 0 reports its bytes in the JSON step line; it holds the largest shards, which is what
`rank_memory(..., pp_rank=0)` predicts. The second step is compared: the model predicts the
steady state, and a pipeline stage's first step also holds what torch's pipelining saves while it
infers the stage's shapes.
"""

from __future__ import annotations

import pytest

from parallel.job import load
from parallel.layout import resolve
from parallel.memory_model import rank_memory
from tests.launch import run_trainer

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("nproc", "parallel"),
    [
        pytest.param(2, {"zero": 1}, id="dp2-zero1"),
        pytest.param(2, {"zero": 2}, id="dp2-zero2"),
        pytest.param(2, {"zero": 3}, id="dp2-zero3"),
        pytest.param(4, {"zero": 1, "tp": 2}, id="dp2-tp2-zero1"),
        pytest.param(4, {"zero": 2, "tp": 2}, id="dp2-tp2-zero2"),
        pytest.param(4, {"zero": 3, "tp": 2}, id="dp2-tp2-zero3"),
        # 64 rows over 3 ranks: uneven, padded shards.
        pytest.param(3, {"zero": 3}, id="dp3-zero3-uneven"),
    ],
)
def test_measured_memory_matches_the_model(nproc, parallel, small_job):
    job = small_job(parallel=parallel)
    result = run_trainer(job, nproc, "--steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    measured = result.steps[2]["memory_bytes"]
    cfg = load(job)
    predicted = rank_memory(cfg.model, resolve(cfg, nproc), cfg.train.seq_len, pp_rank=0)
    for kind in ("params", "grads", "optimizer"):
        assert measured[kind] == getattr(predicted, kind), (kind, measured, predicted)
    assert measured["activations"] == pytest.approx(predicted.activations, rel=0.10), (
        measured, predicted)
