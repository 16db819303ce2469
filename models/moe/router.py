"""Top-k routing and the load-balancing loss of a mixture-of-experts layer.

Routing is a function of the token alone (and, with auxiliary-loss-free balancing, of a
per-expert bias every rank holds alike): softmax over the router's logits (in fp32), the k
largest probabilities, optionally renormalised to sum to 1 (Mixtral and Qwen-MoE's
`norm_topk_prob`). No capacity, no token dropping and no batch statistics enter it, so any
layout that holds a token routes it to the same experts with the same weights.

The load-balancing loss is the Switch Transformer / Mixtral form, E · Σ_e f_e · P_e, with f_e the
share of the k·T routed copies that went to expert e and P_e the mean router probability of e
over T tokens (1 when perfectly balanced). f and P are taken per sequence: a sequence is the unit
every supported layout keeps whole on one rank, so the loss does not depend on dp, ep or the
micro-batch size (a batch-wide f·P would).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Routing:
    weights: torch.Tensor  # (..., k) the routing weights of the chosen experts, fp32
    experts: torch.Tensor  # (..., k) int64 expert indices, by decreasing probability
    probs: torch.Tensor  # (..., E) fp32 softmax over all experts (for the balancing loss)


def route(logits: torch.Tensor, top_k: int, normalise: bool,
          bias: torch.Tensor | None = None) -> Routing:
    """`logits` (..., E) → the top-k experts of every token and their weights.

    `bias` (E,), DeepSeek-V3's auxiliary-loss-free balancing (models.moe.bias_balance): it
    shifts which experts are chosen, never the weights, which stay the chosen probabilities."""
    probs = F.softmax(logits.float(), dim=-1)
    if bias is None:
        weights, experts = probs.topk(top_k, dim=-1)
    else:
        experts = (probs + bias).topk(top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, experts, probs)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Per-sequence balancing loss: probs (batch, seq, E), experts (batch, seq, k) → (batch,).

    E · Σ_e f_e · P_e; f carries no gradient (it counts), P does (it steers the router)."""
    num_experts = probs.shape[-1]
    seq, k = experts.shape[-2], experts.shape[-1]
    counts = F.one_hot(experts, num_experts).sum(dim=(-3, -2)).to(probs.dtype)  # (batch, E)
    share = counts / (seq * k)
    mean_prob = probs.mean(dim=-2)
    return num_experts * (share * mean_prob).sum(dim=-1)
