"""The moe family as Hugging Face's Mixtral (`MixtralForCausalLM`) and Qwen2-MoE
(`Qwen2MoeForCausalLM`): config.json both ways and the table of file tensors (docs/moe.md,
"Hugging Face"). Pure: the job parser calls it.

Both keep attention, norms, RoPE and embeddings under Llama's names. Their files hold one tensor
per routed expert (what transformers 5's `save_pretrained` writes, and every published
checkpoint; transformers 5 fuses them in memory only), which are the slices of our stacked
(E, ·, ·) tensors. Which model type a config exports to follows from what it has: a gated shared
expert (`shared_expert_gate`) is Qwen2-MoE's, everything else must fit Mixtral.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.llama.config import SHAPE_KEYS, shape_from_hf, shape_to_hf
from models.model_config import ConfigError, ModelConfig
from models.moe.config import expert_size, is_moe_layer, moe_layers
from models.spec import HFTensor

MIXTRAL, QWEN2_MOE = "mixtral", "qwen2_moe"
MODEL_TYPES = (MIXTRAL, QWEN2_MOE)
# Our expert tensor -> each model type's name of one expert's matrix.
_EXPERT_NAMES = {MIXTRAL: {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                 QWEN2_MOE: {p: p for p in ("gate_proj", "up_proj", "down_proj")}}
_MLP = {MIXTRAL: "block_sparse_moe", QWEN2_MOE: "mlp"}  # the MoE block's module name


def _get(hf: Mapping[str, Any], key: str, default: Any) -> Any:
    """config.json's value, or transformers' default for a key the file leaves out."""
    value = hf.get(key)
    return default if value is None else value


def _layer_rule(moe: list[int], n: int, source: str, why: str) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq) that make exactly layers `moe` MoE."""
    for freq in range(1, n + 1):
        if moe and [i for i in range(moe[0], n) if i % freq == 0] == moe:
            return moe[0], freq
    raise ConfigError(
        f"{source}: {why} make layers {moe} mixtures of experts, which model.family \"moe\" "
        "cannot express (layer i routes iff i >= first_k_dense_replace and "
        "i % moe_layer_freq == 0)")


def _no_window(hf: Mapping[str, Any], source: str) -> None:
    window = hf.get("sliding_window")
    if window and window < _get(hf, "max_position_embeddings", 0):
        raise ConfigError(f"{source}: sliding_window is not supported (got {window}; our "
                          "attention is full causal)")


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """`[model]` fields from a Mixtral or Qwen2-MoE config.json (transformers' defaults for the
    keys it leaves out). `router_aux_loss_coef` is not taken: our balancing loss is not HF's
    (docs/moe.md), so its weight stays the job's."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{source}: model_type must be one of {', '.join(MODEL_TYPES)} for "
                          f"model.family \"moe\" (got {model_type!r})")
    fields: dict[str, Any] = {"family": "moe", **shape_from_hf(hf, source, SHAPE_KEYS),
                              "attention_bias": False, "mlp_bias": False}
    if model_type == MIXTRAL:
        _no_window(hf, source)
        if _get(hf, "router_jitter_noise", 0.0):
            raise ConfigError(f"{source}: router_jitter_noise is not supported (got "
                              f"{hf['router_jitter_noise']!r}; our routing has no noise)")
        width = _get(hf, "intermediate_size", 14336)
        return fields | {
            "num_experts": _get(hf, "num_local_experts", 8),
            "num_experts_per_tok": _get(hf, "num_experts_per_tok", 2),
            "intermediate_size": width, "moe_intermediate_size": width,
            "norm_topk_prob": True, "qkv_bias": False, "num_shared_experts": 0,
            "shared_expert_gate": False, "first_k_dense_replace": 0, "moe_layer_freq": 1,
        }
    if _get(hf, "use_sliding_window", False):
        raise ConfigError(f"{source}: use_sliding_window is not supported (got true; our "
                          "attention is full causal)")
    width = _get(hf, "moe_intermediate_size", 1408)
    shared = _get(hf, "shared_expert_intermediate_size", 5632)
    if not isinstance(width, int) or width < 1 or not isinstance(shared, int) or shared < width \
            or shared % width:
        raise ConfigError(f"{source}: shared_expert_intermediate_size must be a positive "
                          f"multiple of moe_intermediate_size (got {shared!r}, {width!r}): our "
                          "shared experts are num_shared_experts experts wide")
    n = _get(hf, "num_hidden_layers", 24)
    step, dense = _get(hf, "decoder_sparse_step", 1), set(_get(hf, "mlp_only_layers", []))
    experts = _get(hf, "num_experts", 60)
    moe = [i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0]
    first_k, freq = _layer_rule(moe, n, source, f"mlp_only_layers {sorted(dense)} and "
                                                f"decoder_sparse_step {step}")
    return fields | {
        "num_experts": experts,
        "num_experts_per_tok": _get(hf, "num_experts_per_tok", 4),
        "moe_intermediate_size": width,
        "norm_topk_prob": _get(hf, "norm_topk_prob", False),
        "qkv_bias": _get(hf, "qkv_bias", True),  # transformers 4's Qwen2-MoE: always biased
        "num_shared_experts": shared // width, "shared_expert_gate": True,
        "first_k_dense_replace": first_k, "moe_layer_freq": freq,
    }


def model_type_of(m: ModelConfig) -> str:
    """The Hugging Face model type that holds `m` exactly: Qwen2-MoE's when it has a gated
    shared expert, else Mixtral's. ConfigError naming the field that neither can hold."""
    if m.router_bias_update_rate:
        raise ConfigError("model.router_bias_update_rate: Mixtral and Qwen2-MoE have no routing "
                          "bias, so an export would route differently")
    if m.shared_expert_gate:
        if m.attention_bias:
            raise ConfigError("model.attention_bias: Qwen2-MoE has no o_proj bias (set "
                              "model.qkv_bias for q, k and v biases)")
        return QWEN2_MOE
    dense_key = "first_k_dense_replace" if m.first_k_dense_replace else "moe_layer_freq"
    problems = {
        "num_shared_experts": m.num_shared_experts != 0,
        dense_key: len(moe_layers(m)) != m.num_hidden_layers,
        "norm_topk_prob": not m.norm_topk_prob,
        "attention_bias": m.attention_bias,
        "qkv_bias": m.qkv_bias,
    }
    bad = [key for key, wrong in problems.items() if wrong]
    if bad:
        raise ConfigError(
            f"model.{bad[0]} = {getattr(m, bad[0])!r}: no Hugging Face model type holds this "
            "model (Mixtral: every layer MoE, renormalised top-k, no shared experts, no "
            "biases; Qwen2-MoE: a gated shared expert, model.shared_expert_gate)")
    return MIXTRAL


def config_to_hf(m: ModelConfig) -> dict[str, Any]:
    """config.json of `m` as a Mixtral or a Qwen2-MoE (`model_type_of`)."""
    model_type = model_type_of(m)
    base = shape_to_hf(m, SHAPE_KEYS) | {
        "num_experts_per_tok": m.num_experts_per_tok,
        "router_aux_loss_coef": m.router_aux_loss_coef, "output_router_logits": False}
    if model_type == MIXTRAL:
        return {"architectures": ["MixtralForCausalLM"], "model_type": MIXTRAL, **base,
                "intermediate_size": expert_size(m), "num_local_experts": m.num_experts,
                "sliding_window": None, "router_jitter_noise": 0.0}
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": QWEN2_MOE, **base,
            "num_experts": m.num_experts, "moe_intermediate_size": expert_size(m),
            "shared_expert_intermediate_size": m.num_shared_experts * expert_size(m),
            "norm_topk_prob": m.norm_topk_prob, "qkv_bias": m.qkv_bias,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(m.num_hidden_layers) if not is_moe_layer(m, i)],
            "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": m.num_hidden_layers}


def _moe_block(m: ModelConfig, model_type: str, ours: str, hf: str) -> list[HFTensor]:
    block = f"{hf}{_MLP[model_type]}."
    out = [HFTensor(f"{block}gate.weight", f"{ours}mlp.gate.weight")]
    for ours_proj, hf_proj in _EXPERT_NAMES[model_type].items():
        out += [HFTensor(f"{block}experts.{j}.{hf_proj}.weight", f"{ours}mlp.experts.{ours_proj}",
                         j) for j in range(m.num_experts)]
    if m.num_shared_experts:  # Qwen2-MoE's (model_type_of refuses them for Mixtral)
        out += [HFTensor(f"{block}shared_expert.{p}.weight", f"{ours}mlp.shared_experts.{p}.weight")
                for p in ("gate_proj", "up_proj", "down_proj")]
        out.append(HFTensor(f"{block}shared_expert_gate.weight",
                            f"{ours}mlp.shared_expert_gate.weight"))
    return out


def tensors(m: ModelConfig) -> list[HFTensor]:
    """Every tensor of the model's files, in our module order; a stacked expert tensor's
    slices are consecutive (the export reads each of our tensors once)."""
    model_type = model_type_of(m)
    out = [HFTensor("model.embed_tokens.weight", "embed_tokens.weight")]
    qkv_bias = m.attention_bias or m.qkv_bias
    for i in range(m.num_hidden_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        names = ["input_layernorm.weight"]
        for proj, bias in (("q_proj", qkv_bias), ("k_proj", qkv_bias), ("v_proj", qkv_bias),
                           ("o_proj", m.attention_bias)):
            names += [f"self_attn.{proj}.weight"] + ([f"self_attn.{proj}.bias"] if bias else [])
        names.append("post_attention_layernorm.weight")
        out += [HFTensor(hf + n, ours + n) for n in names]
        if is_moe_layer(m, i):
            out += _moe_block(m, model_type, ours, hf)
        else:
            out += [HFTensor(f"{hf}mlp.{p}.weight", f"{ours}mlp.{p}.weight")
                    for p in ("gate_proj", "up_proj", "down_proj")]
    out.append(HFTensor("model.norm.weight", "norm.weight"))
    if not m.tie_word_embeddings:
        out.append(HFTensor("lm_head.weight", "lm_head.weight"))
    return out
