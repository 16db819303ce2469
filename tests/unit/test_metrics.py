"""The agent's metrics from plans, step and checkpoint reports and etcd's records: memory
predicted and measured, steps re-run after a restore, job state, newest checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.control.records import CheckpointRecord, JobState, Progress
from daemon.metrics import MEMORY_KINDS, Metrics
from daemon.recovery_phases import Recovery
from parallel.job import loads
from parallel.memory_model import peak_memory
from parallel.planner import NodeInfo, Plan, Restore, plan_generation
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


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _plan(generation: int, reason: str, restore_step: int) -> Plan:
    job = loads(JOB)
    plan = plan_generation(job, [NodeInfo("a", 2)], generation, ("h", 1))
    return dataclasses.replace(plan, reason=reason,
                               restore=Restore("checkpoint" if restore_step else "init",
                                               restore_step))


def test_lost_steps_count_the_steps_a_restore_trains_again() -> None:
    metrics = Metrics()
    lost = ("ultra_lost_steps_total", ())
    metrics.observe_plan(_plan(1, "start", 0), Progress())
    for step in range(1, 8):
        metrics.observe_step(pb.StepReport(generation=1, step=step))
    metrics.observe_plan(_plan(2, "failure", 4), Progress(generation=1, step=6))
    assert _samples(metrics)[lost] == 3  # steps 5..7 again
    # A straggling report of generation 1 is not progress of generation 2.
    metrics.observe_step(pb.StepReport(generation=1, step=7))
    metrics.observe_step(pb.StepReport(generation=2, step=5))
    # This node took no part in generation 3; etcd's progress says it reached step 9.
    metrics.observe_plan(_plan(3, "failure", 5), Progress(generation=2, step=5))
    metrics.observe_plan(_plan(4, "leave", 8), Progress(generation=3, step=9))
    assert _samples(metrics)[lost] == 3 + 0 + 1
    # A planned change restores the step it stopped at; a new job starts over at 0.
    metrics.observe_plan(_plan(5, "drain", 9), Progress(generation=4, step=9))
    metrics.observe_plan(_plan(6, "job", 0), Progress(generation=5, step=12))
    assert _samples(metrics)[lost] == 4


def test_job_state_and_newest_checkpoint_come_from_the_records() -> None:
    metrics = Metrics()
    samples = _samples(metrics)
    assert samples[("ultra_job_state", (("state", "none"),))] == 1
    assert samples[("ultra_checkpoint_last_step", ())] == -1
    assert samples[("ultra_checkpoint_last_timestamp_seconds", ())] == 0
    metrics.observe_job(JobState.RUNNING, CheckpointRecord(2, 40, "/c", time=1234.5))
    samples = _samples(metrics)
    assert {s.value: samples[("ultra_job_state", (("state", s.value),))] for s in JobState} \
        == {"none": 0, "pending": 0, "running": 1, "failed": 0, "finished": 0, "cancelled": 0}
    assert samples[("ultra_checkpoint_last_step", ())] == 40
    assert samples[("ultra_checkpoint_last_timestamp_seconds", ())] == 1234.5


def test_checkpoint_duration_is_observed_from_rank_zeros_report() -> None:
    metrics = Metrics()
    labels = (("op", "save"), ("tier", "durable"))
    assert _samples(metrics)[("ultra_checkpoint_duration_seconds_count", labels)] == 0
    metrics.observe_checkpoint(pb.CheckpointReport(step=4, path="/c"))  # an older worker
    metrics.observe_checkpoint(pb.CheckpointReport(step=8, path="/c", seconds=1.5))
    samples = _samples(metrics)
    assert samples[("ultra_checkpoint_duration_seconds_count", labels)] == 1
    assert samples[("ultra_checkpoint_duration_seconds_sum", labels)] == 1.5


def test_checkpoint_blocking_is_observed_per_tier_from_step_reports() -> None:
    metrics = Metrics()
    memory, durable = (("tier", "memory"),), (("tier", "durable"),)
    count = "ultra_checkpoint_blocking_seconds_count"
    assert _samples(metrics)[(count, memory)] == _samples(metrics)[(count, durable)] == 0
    metrics.observe_step(pb.StepReport(generation=1, step=1))  # nothing taken after step 0
    metrics.observe_step(pb.StepReport(generation=1, step=2, snapshot_blocking_seconds=0.004))
    metrics.observe_step(pb.StepReport(generation=1, step=3, snapshot_blocking_seconds=0.02,
                                       checkpoint_blocking_seconds=0.3))
    samples = _samples(metrics)
    assert samples[(count, memory)] == 2
    assert samples[("ultra_checkpoint_blocking_seconds_sum", memory)] == pytest.approx(0.024)
    assert samples[(count, durable)] == 1
    assert samples[("ultra_checkpoint_blocking_seconds_sum", durable)] == pytest.approx(0.3)
    assert samples[("ultra_checkpoint_blocking_seconds_bucket",
                    (("le", "0.005"), ("tier", "memory")))] == 1


def test_a_recovery_is_observed_per_phase_and_in_total() -> None:
    metrics = Metrics()
    phases = ("detect", "rendezvous", "restore", "first_step", "total")
    count = "ultra_recovery_duration_seconds_count"
    assert {p: _samples(metrics)[(count, (("phase", p),))] for p in phases} \
        == dict.fromkeys(phases, 0)  # exported before the first recovery
    metrics.observe_recovery(Recovery(detect=0.1, rendezvous=1.0, restore=0.5, first_step=2.0))
    samples = _samples(metrics)
    sums = {p: samples[("ultra_recovery_duration_seconds_sum", (("phase", p),))] for p in phases}
    assert sums == pytest.approx({"detect": 0.1, "rendezvous": 1.0, "restore": 0.5,
                                  "first_step": 2.0, "total": 3.6})
    assert {p: samples[(count, (("phase", p),))] for p in phases} == dict.fromkeys(phases, 1)
    # UltraRecoverySlow reads the total's le="60.0" bucket.
    assert samples[("ultra_recovery_duration_seconds_bucket",
                    (("le", "60.0"), ("phase", "total")))] == 1
