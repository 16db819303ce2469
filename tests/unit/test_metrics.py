"""ultra_memory_bytes{kind,source}: predicted from the plan, measured from a worker's report."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.api.metrics import MEMORY_KINDS, Metrics
from parallel.job import loads
from parallel.memory_model import peak_memory
from parallel.planner import NodeInfo, plan_generation
from proto.ultrascale.v1 import agent_pb2 as pb

pytestmark = pytest.mark.unit

JOB = """
[data]
source = "synthetic"
[model]
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 256
[train]
global_batch = 8
seq_len = 32
[parallel]
zero = 2
"""


def _memory_samples(metrics: Metrics) -> dict[tuple[str, str], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.labels["kind"], s.labels["source"]): s.value
            for fam in text_string_to_metric_families(text) if fam.name == "ultra_memory_bytes"
            for s in fam.samples}


def test_memory_gauge_has_the_plans_prediction_and_the_reported_measurement() -> None:
    job = loads(JOB)
    plan = plan_generation(job, [NodeInfo("a", 2)], 1, ("h", 1))
    predicted = peak_memory(job.model, plan.layout, job.train.seq_len)
    metrics = Metrics()
    metrics.observe_plan(plan)
    metrics.observe_step(pb.StepReport(
        generation=1, step=1, memory_params_bytes=10, memory_grads_bytes=20,
        memory_optimizer_bytes=30, memory_activations_bytes=40))
    samples = _memory_samples(metrics)
    for n, kind in enumerate(MEMORY_KINDS, start=1):
        assert samples[(kind, "predicted")] == getattr(predicted, kind) > 0
        assert samples[(kind, "measured")] == 10 * n
