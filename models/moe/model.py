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
from models.moe import dispatch
from models.moe.aux_loss import RouterAuxLoss
from models.moe.config import expert_size, moe_layers
from models.moe.router import route
from parallel.job import ModelConfig


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's part of a parameter (a DTensor's local shard: its experts under ep)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class Experts(nn.Module):
    """E SwiGLU experts; under expert parallelism each rank holds a contiguous block of them."""

    def __init__(self, num_experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows (N, h) grouped by local expert, counts[j] rows for local expert j → (N, h).

        An expert with no rows still runs (on an empty block), so every local expert gets a
        gradient, zero or not: data-parallel reductions then see the same tensors on every rank.
        """
        gate, up, down = (local_tensor(p) for p in (self.gate_proj, self.up_proj, self.down_proj))
        outs = [
            F.linear(F.silu(F.linear(block, gate[j])) * F.linear(block, up[j]), down[j])
            for j, block in enumerate(rows.split(counts))
        ]
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
