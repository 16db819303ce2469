"""The permutation of a mixture-of-experts layer: token copies grouped by expert, and back.

Each of T tokens is routed to k experts, giving T·k copies. `plan` sorts the copies by expert
(stably, so within an expert they keep token order); `permute` gathers the tokens in that order,
so expert e's rows are one contiguous block of `counts[e]` rows; `combine` puts the experts'
outputs back in token order and sums each token's k outputs weighted by its routing weights.
Expert parallelism (parallel.expert_parallel) moves the blocks between ranks in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchPlan:
    order: torch.Tensor  # (T·k,) index into the flattened (T, k) copies, sorted by expert
    inverse: torch.Tensor  # (T·k,) the inverse permutation of `order`
    counts: torch.Tensor  # (E,) int64 copies per expert
    top_k: int


def plan(experts: torch.Tensor, num_experts: int) -> DispatchPlan:
    """`experts` (T, k) int64 → the grouping of its T·k copies by expert."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=num_experts)
    return DispatchPlan(order, inverse, counts, experts.shape[-1])


def permute(tokens: torch.Tensor, p: DispatchPlan) -> torch.Tensor:
    """tokens (T, h) → (T·k, h): copy i is token order[i] // k."""
    return tokens[p.order // p.top_k]


def combine(outputs: torch.Tensor, p: DispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    """outputs (T·k, h) in expert order, weights (T, k) → (T, h), the weighted sum per token."""
    tokens = weights.shape[0]
    per_copy = outputs[p.inverse].view(tokens, p.top_k, -1)
    return (per_copy * weights.unsqueeze(-1).to(per_copy.dtype)).sum(dim=1)
