"""A MoE step's expert figures, from the trainer's step result to the agent's series:
`expert_telemetry` (layers named, dropped copies counted) and `ExpertMetrics` (per-expert
tokens, per-layer imbalance, the balancing loss, bounded label sets)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from daemon.expert_metrics import MAX_EXPERT_SERIES
from daemon.metrics import Metrics
from parallel.job import loads
from proto.ultrascale.v1 import agent_pb2 as pb
from tests.unit.test_telemetry import _samples
from trainer.telemetry import expert_telemetry

pytestmark = pytest.mark.unit

# 3 layers, the first dense: MoE layers 1 and 2, 4 experts, top-2; 10 samples x 8 tokens.
JOB = """
[model]
family = "moe"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 3
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 64
max_position_embeddings = 16
num_experts = 4
num_experts_per_tok = 2
first_k_dense_replace = 1
[data]
path = "tokens.bin"
[train]
global_batch = 10
seq_len = 8
"""


def test_expert_telemetry_names_the_moe_layers_and_counts_no_drop_when_every_copy_ran() -> None:
    job = loads(JOB, [])
    full = ((40, 40, 60, 20), (10, 70, 50, 30))  # 10 x 8 tokens x top-2 = 160 per layer
    r = SimpleNamespace(expert_load=full, aux_loss=0.25)
    t = expert_telemetry(r, job)
    assert t is not None
    assert t.load == {1: full[0], 2: full[1]} and t.aux_loss == 0.25 and t.dropped == 0
    short = SimpleNamespace(expert_load=((40, 40, 60, 15), full[1]), aux_loss=0.25)
    assert expert_telemetry(short, job).dropped == 5  # type: ignore[union-attr]
    assert expert_telemetry(SimpleNamespace(expert_load=(), aux_loss=None), job) is None


def test_the_agent_exports_tokens_per_expert_imbalance_aux_loss_and_drops() -> None:
    metrics = Metrics()
    metrics.observe_step(pb.StepReport(
        generation=1, step=1, loss=3.0, aux_loss=0.125, dropped_tokens=0,
        expert_load=[pb.ExpertLoad(layer=1, tokens=[40, 40, 60, 20]),
                     pb.ExpertLoad(layer=2, tokens=[0, 0, 0, 0])]))
    metrics.observe_step(pb.StepReport(generation=1, step=2, loss=3.0, dropped_tokens=7))
    got = _samples(metrics)
    assert got[("ultra_moe_aux_loss", ())] == 0.125
    assert got[("ultra_moe_expert_tokens", (("expert", "2"), ("layer", "1")))] == 60
    assert got[("ultra_moe_expert_imbalance", (("layer", "1"),))] == 60 * 4 / 160
    assert got[("ultra_moe_expert_imbalance", (("layer", "2"),))] == 0  # nothing routed
    assert got[("ultra_moe_dropped_tokens_total", ())] == 7


def test_a_dense_job_exports_no_expert_series() -> None:
    metrics = Metrics()
    metrics.observe_step(pb.StepReport(generation=1, step=1, loss=3.0))
    assert not any(name in ("ultra_moe_expert_tokens", "ultra_moe_expert_imbalance")
                   for name, _ in _samples(metrics))


def test_label_sets_stay_bounded_whatever_a_worker_reports() -> None:
    """Per-expert series only up to MAX_EXPERT_SERIES (the imbalance stays per layer); a layer
    index no model has is not exported."""
    metrics = Metrics()
    experts = MAX_EXPERT_SERIES // 2 + 1
    metrics.observe_step(pb.StepReport(generation=1, step=1, loss=3.0, expert_load=[
        pb.ExpertLoad(layer=0, tokens=[1] * experts), pb.ExpertLoad(layer=1, tokens=[1] * experts),
        pb.ExpertLoad(layer=-1, tokens=[1]), pb.ExpertLoad(layer=10**6, tokens=[1])]))
    got = _samples(metrics)
    assert not any(name == "ultra_moe_expert_tokens" for name, _ in got)
    assert {labels for name, labels in got if name == "ultra_moe_expert_imbalance"} == {
        (("layer", "0"),), (("layer", "1"),)}
