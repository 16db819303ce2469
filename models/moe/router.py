"""Top-k routing and the load-balancing loss of a mixture-of-experts layer.

Routing is a function of the token alone (and, with auxiliary-loss-free balancing, of a
per-expert bias every rank holds alike): softmax over the router's logits (in fp32), the k
largest probabilities, optionally renormalised to sum to 1 (Mixtral and Qwen-MoE's
`norm_topk_prob`). No capacity, no token dropping and no batch statistics enter it, so any
layout that holds a token routes it to the same experts with the same weights.

The load-balancing loss is the Switch Transformer / Mixtral form, E · Σ_e f_e · P_e, with f_e the
share of the k·T routed copies that went to expert e and P_e the mean router probability of e
over T tokens (1 when perfectly balanced). f and P are taken per sequence, so the loss does not
depend on dp, ep or the micro-batch size (a batch-wide f·P would). Context parallelism splits a
sequence over the cp ranks: they then sum f's counts over cp, and each computes its share of
the loss with its own tokens' part of P (`load_balancing_loss(counts=, seq_len=)`).
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


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """experts (batch, seq, k) → (batch, E) int64: each sequence's routed copies per expert."""
    return F.one_hot(experts, num_experts).sum(dim=(-3, -2))


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor,
                        counts: torch.Tensor | None = None,
                        seq_len: int | None = None) -> torch.Tensor:
    """Per-sequence balancing loss: probs (batch, seq, E), experts (batch, seq, k) → (batch,).

    E · Σ_e f_e · P_e; f carries no gradient (it counts), P does (it steers the router).

    A share of each sequence (context parallelism): `counts` (batch, E) are the whole
    sequences' copies per expert and `seq_len` their length; the result is then this share's
    part E · Σ_e f_e · (Σ_{its tokens} p_e) / seq_len, and the parts of all shares add up to
    the whole sequences' loss (P is a sum over tokens, f the same constant on every share), as
    does their gradient: each token's probability gets E · f_e / seq_len either way.
    """
    num_experts = probs.shape[-1]
    k = experts.shape[-1]
    if counts is None:
        seq = experts.shape[-2]
        share = expert_counts(experts, num_experts).to(probs.dtype) / (seq * k)
        return num_experts * (share * probs.mean(dim=-2)).sum(dim=-1)
    assert seq_len is not None, "counts of whole sequences need their length"
    share = counts.to(probs.dtype) / (seq_len * k)
    return num_experts * (share * (probs.sum(dim=-2) / seq_len)).sum(dim=-1)
