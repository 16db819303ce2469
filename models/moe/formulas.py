"""Parameter counts of the moe family (pure): total, and active per token.

A token passes through every attention block, norm, router and shared expert, but only
num_experts_per_tok of a MoE layer's routed experts: its compute follows the active count, the
memory of the model state the total.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.llama import formulas as llama
from models.model_config import ModelConfig
from models.moe.config import expert_size, moe_layers
from models.spec import ParamCounts, ParamShape


@dataclass(frozen=True)
class MoECounts:
    total: int
    active: int  # parameters one token's forward uses
    experts: int  # routed-expert parameters, all layers (what expert parallelism shards)


def _numel(shapes: tuple[ParamShape, ...]) -> int:
    n = 0
    for p in shapes:
        size = 1
        for d in p.shape:
            size *= d
        n += size
    return n


def _moe_mlp(m: ModelConfig) -> tuple[ParamShape, ...]:
    """A MoE layer's MLP without its routed experts: the router, the shared experts and their
    gate (replicated over tp: models/moe/sharding.py)."""
    h, shared = m.hidden_size, m.num_shared_experts * expert_size(m)
    out = (ParamShape((m.num_experts, h), None),)
    if shared:
        out += (ParamShape((shared, h), None), ParamShape((shared, h), None),
                ParamShape((h, shared), None))
    if m.shared_expert_gate:
        out += (ParamShape((1, h), None),)
    return out


def _routed(m: ModelConfig) -> tuple[ParamShape, ...]:
    e, h, i = m.num_experts, m.hidden_size, expert_size(m)
    return (ParamShape((e, i, h), None, ep_dim=0), ParamShape((e, i, h), None, ep_dim=0),
            ParamShape((e, h, i), None, ep_dim=0))


def moe_counts(m: ModelConfig) -> MoECounts:
    dense = llama.param_counts(m)
    dense_mlp = 3 * m.hidden_size * m.intermediate_size
    attention_and_norms = dense.per_layer - dense_mlp
    n_moe = len(moe_layers(m))
    n_dense = m.num_hidden_layers - n_moe
    routed = _numel(_routed(m))
    per_expert = routed // m.num_experts
    outside = dense.embedding + dense.head + dense.final_norm
    common = (outside + m.num_hidden_layers * attention_and_norms + n_dense * dense_mlp
              + n_moe * _numel(_moe_mlp(m)))
    return MoECounts(
        total=common + n_moe * routed,
        active=common + n_moe * m.num_experts_per_tok * per_expert,
        experts=n_moe * routed,
    )


def param_shapes(m: ModelConfig) -> dict[str, tuple[ParamShape, ...]]:
    """Llama's, with "layer" the largest layer: a MoE layer's (attention, norms, router,
    shared and routed experts). The memory model assumes equal layers, so with dense layers
    mixed in it over-counts them (docs/moe.md)."""
    shapes = llama.param_shapes(m)
    dense_layer = shapes["layer"]
    attention_and_norms = dense_layer[:-3]  # gate, up, down come last (mlp_bias is rejected)
    return shapes | {"layer": attention_and_norms + _moe_mlp(m) + _routed(m)}


def param_counts(m: ModelConfig) -> ParamCounts:
    """Per layer: the mean over layers (dense-first layers are smaller), rounded up, so the
    total is exact when every layer is MoE and over by less than num_hidden_layers otherwise."""
    dense = llama.param_counts(m)
    counts = moe_counts(m)
    layers = counts.total - dense.embedding - dense.head - dense.final_norm
    return ParamCounts(
        per_layer=-(-layers // m.num_hidden_layers),
        per_layer_norms=dense.per_layer_norms,
        embedding=dense.embedding,
        head=dense.head,
        final_norm=dense.final_norm,
        num_layers=m.num_hidden_layers,
        inactive=counts.total - counts.active,
    )
