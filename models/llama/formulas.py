"""Llama's parameter and FLOP counts (pure), for the memory and cost models (parallel/)."""

from __future__ import annotations

from models.model_config import ModelConfig
from models.spec import ParamCounts, ParamShape


def param_counts(model: ModelConfig) -> ParamCounts:
    """Parameter counts of models/llama/model.py's Llama (GQA; SwiGLU MLP; optional biases).

    The playbook's generic count, h·v + L·(12h² + 13h) + 2h ("Memory usage in Transformers"),
    assumes a 4h GELU MLP with biases; a Llama layer has q and o of h × (heads · head_dim), k and
    v of h × (kv_heads · head_dim), three h × intermediate MLP matrices and two norm weights.
    """
    shapes = param_shapes(model)
    norms = 2 * model.hidden_size
    embedding = model.vocab_size * model.hidden_size
    return ParamCounts(
        per_layer=sum(_numel(p) for p in shapes["layer"]),
        per_layer_norms=norms,
        embedding=embedding,
        head=0 if model.tie_word_embeddings else embedding,
        final_norm=model.hidden_size,
        num_layers=model.num_hidden_layers,
    )


def _numel(p: ParamShape) -> int:
    n = 1
    for d in p.shape:
        n *= d
    return n


def param_shapes(model: ModelConfig) -> dict[str, tuple[ParamShape, ...]]:
    """Parameter tensors by where they live: "layer" (one decoder layer), "embedding",
    "final_norm" and "head" (empty when tied to the embedding), with the dim models/llama/
    sharding.py splits over tp: column-wise q/k/v/gate/up (and their biases) and the head on dim
    0, row-wise o/down on dim 1 (their biases replicated), the embedding on the vocabulary.
    The embedding's gradient comes out of DTensor's embedding backward whole."""
    h, i = model.hidden_size, model.intermediate_size
    q_dim = model.num_attention_heads * model.head_dim
    kv_dim = model.num_key_value_heads * model.head_dim
    attn_bias = (
        (ParamShape((q_dim,), 0), ParamShape((kv_dim,), 0), ParamShape((kv_dim,), 0))
        if model.attention_bias or model.qkv_bias else ()
    ) + ((ParamShape((h,), None),) if model.attention_bias else ())  # o_proj's
    mlp_bias = (
        (ParamShape((i,), 0), ParamShape((i,), 0), ParamShape((h,), None))
        if model.mlp_bias else ()
    )
    layer = (
        ParamShape((h,), None),  # input_layernorm
        ParamShape((q_dim, h), 0), ParamShape((kv_dim, h), 0), ParamShape((kv_dim, h), 0),
        ParamShape((h, q_dim), 1),  # o_proj
        *attn_bias,
        ParamShape((h,), None),  # post_attention_layernorm
        ParamShape((i, h), 0), ParamShape((i, h), 0), ParamShape((h, i), 1),  # gate, up, down
        *mlp_bias,
    )
    head = () if model.tie_word_embeddings else (ParamShape((model.vocab_size, h), 0),)
    return {"layer": layer, "embedding": (ParamShape((model.vocab_size, h), 0, whole_grad=True),),
            "final_norm": (ParamShape((h,), None),), "head": head}


def attention_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of QKᵀ and softmax·V over all layers: 4·L·(a·d)·s, 2·s·a·d each
    (a·d = h unless head_dim says otherwise).

    The dense-weight estimate of the playbook ("Memory usage in Transformers", compute) leaves
    attention out; at long sequences it is no longer small. Counted without the causal half, as
    usual for MFU.
    """
    q_dim = model.num_attention_heads * model.head_dim
    return 4.0 * model.num_hidden_layers * q_dim * seq_len
