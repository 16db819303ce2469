"""A Llama-style decoder whose MLPs are (some or all) mixtures of experts: Mixtral, Qwen-MoE
and DeepSeek-style shared experts and dense-first layers (docs/moe.md).

Attention, norms, RoPE, embeddings and the dense MLP are models/llama/model.py's. A MoE layer's
MLP is `MoE`: a router (`gate`), `num_experts` SwiGLU experts stored as three (E, ·, ·) tensors,
dropless top-k routing, and optionally one dense SwiGLU of num_shared_experts experts' width that
every token passes through (its output scaled by a sigmoid gate with `shared_expert_gate`).
Nothing here knows about meshes: expert parallelism swaps `exchange` (parallel.expert_parallel),
as context parallelism swaps attention's `core`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.llama.model import MLP, Llama
from models.model_config import ModelConfig
from models.moe import dispatch
from models.moe.aux_loss import RouterAuxLoss
from models.moe.config import expert_size, moe_layers
from models.moe.router import route


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's part of a parameter (a DTensor's local shard: its experts under ep)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


# Receives, per source, the gradients of an Experts module's PARAMS from that source's rows
# alone (parallel.reproducible sets it; models.moe.model.Experts.gradient_sink).
GradientSink = Callable[[int, tuple[torch.Tensor, ...]], None]


class _SourceGradients(torch.autograd.Function):
    """Identity on the expert weights; backward hands their gradient from one source's rows to
    the sink instead of letting autograd add it to the other sources' (an fp32 sum whose
    grouping would depend on the layout)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, sink: GradientSink, source: int,
                *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.sink, ctx.source = sink, source  # type: ignore[attr-defined]
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 *grads: torch.Tensor) -> tuple[None, ...]:
        ctx.sink(ctx.source, grads)  # type: ignore[attr-defined]
        return (None, None, *(None for _ in grads))


class Experts(nn.Module):
    """E SwiGLU experts; under expert parallelism each rank holds a contiguous block of them."""

    PARAMS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))
        # parallel.reproducible: each source's gradients go here, not into .grad.
        self.gradient_sink: GradientSink | None = None

    def forward(self, rows: torch.Tensor, counts: list[int], sources: int = 1) -> torch.Tensor:
        """rows (N, h) in blocks of counts[i] rows → (N, h). Block i is source i // L's rows
        for local expert i % L (L local experts): with one source (the default), one block per
        expert; under expert parallelism with a gradient sink, one per (sending rank, expert),
        each the rows one micro-batch routed there, as one process would run them.

        An expert with no rows still runs (on an empty block), so every local expert gets a
        gradient, zero or not: data-parallel reductions then see the same tensors on every rank.
        """
        weights = tuple(local_tensor(getattr(self, name)) for name in self.PARAMS)
        blocks = rows.split(counts)
        local = len(counts) // sources
        outs = []
        for source in range(sources):
            gate, up, down = (weights if self.gradient_sink is None
                              else _SourceGradients.apply(self.gradient_sink, source, *weights))
            for j, block in enumerate(blocks[source * local:(source + 1) * local]):
                outs.append(F.linear(F.silu(F.linear(block, gate[j])) * F.linear(block, up[j]),
                                     down[j]))
        return torch.cat(outs)


# (copies grouped by expert, copies per expert, the experts) -> their outputs, same order.
Exchange = Callable[[torch.Tensor, torch.Tensor, Experts], torch.Tensor]


def run_local_experts(rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert on this rank: no exchange."""
    return experts(rows, counts.tolist())


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, aux: RouterAuxLoss, layer: int) -> None:
        super().__init__()
        self.layer = layer  # its decoder layer's index (the key of its expert load)
        self.num_experts, self.top_k, self.normalise = (
            cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, expert_size(cfg))
        self.shared_experts: MLP | None = (
            MLP(dataclasses.replace(
                cfg, intermediate_size=cfg.num_shared_experts * expert_size(cfg)))
            if cfg.num_shared_experts else None
        )
        # Qwen2-MoE's: sigmoid(x · w) scales the shared experts' output, token by token.
        self.shared_expert_gate: nn.Linear | None = (
            nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None)
        self.exchange: Exchange = run_local_experts
        self.aux = aux
        # DeepSeek-V3's balancing bias (models.moe.bias_balance): state, not a parameter (no
        # gradient, no optimizer), checkpointed with the model; zero at start.
        self.expert_bias: torch.Tensor | None
        if cfg.router_bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        routing = route(self.gate(flat), self.top_k, self.normalise, self.expert_bias)
        p = dispatch.plan(routing.experts, self.num_experts)
        outputs = self.exchange(dispatch.permute(flat, p), p.counts, self.experts)
        out = dispatch.combine(outputs, p, routing.weights).view(b, s, h)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.aux.attach(out, routing.probs.view(b, s, -1),
                               routing.experts.view(b, s, self.top_k), self.layer)


class MoETransformer(Llama):
    """Llama with MoE MLPs in the layers `models.moe.config.is_moe_layer` names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        # Shared by the layers, set per micro-batch by the trainer (models.moe.aux_loss).
        self.router_aux = RouterAuxLoss()
        for i in moe_layers(cfg):
            self.layers[str(i)].mlp = MoE(cfg, self.router_aux, i)


def build_model(cfg: ModelConfig) -> MoETransformer:
    with torch.device("meta"):
        return MoETransformer(cfg)
