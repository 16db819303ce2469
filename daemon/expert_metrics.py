"""A mixture-of-experts job's expert figures as Prometheus series (docs/observability.md).

Every agent exports the same global figures (its first local rank reports them, summed over all
ranks), so dashboards take max() over instances. Per-expert series number layers x experts;
past `MAX_EXPERT_SERIES` only the per-layer imbalance is exported, which stays readable for a
256-expert, 60-layer model.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from proto.ultrascale.v1 import agent_pb2 as pb

MAX_EXPERT_SERIES = 4096  # layers x experts exported one series each
MAX_LAYER = 4096  # a worker's layer index past this is not a decoder layer of any model we build


@dataclass
class ExpertMetrics:
    registry: CollectorRegistry

    def __post_init__(self) -> None:
        r = self.registry
        self.aux_loss = Gauge("ultra_moe_aux_loss", "Load-balancing loss of the last step "
                              "(weighted, summed over MoE layers)", registry=r)
        self.tokens = Gauge("ultra_moe_expert_tokens", "Routed token copies each expert of a "
                            "MoE layer computed in the last step (all ranks)",
                            ["layer", "expert"], registry=r)
        self.imbalance = Gauge("ultra_moe_expert_imbalance", "Busiest expert's copies over the "
                               "mean of a MoE layer in the last step (1: balanced)", ["layer"],
                               registry=r)
        self.dropped = Counter("ultra_moe_dropped_tokens_total", "Routed token copies no expert "
                               "computed (0 while the routing is dropless)", registry=r)

    def observe(self, report: pb.StepReport) -> None:
        if report.HasField("aux_loss"):
            self.aux_loss.set(report.aux_loss)
        if report.HasField("dropped_tokens") and report.dropped_tokens > 0:
            self.dropped.inc(report.dropped_tokens)
        rows = [row for row in report.expert_load if 0 <= row.layer < MAX_LAYER and row.tokens]
        per_expert = sum(len(row.tokens) for row in rows) <= MAX_EXPERT_SERIES
        for row in rows:
            layer = str(row.layer)
            total = sum(row.tokens)
            self.imbalance.labels(layer=layer).set(
                max(row.tokens) * len(row.tokens) / total if total > 0 else 0.0)
            if per_expert:
                for expert, count in enumerate(row.tokens):
                    self.tokens.labels(layer=layer, expert=str(expert)).set(count)
