"""Llama's `[model]` checks and its mapping to and from Hugging Face's config.json (`LlamaConfig`:
transformers 4's `rope_theta` + `rope_scaling` and transformers 5's `rope_parameters` both read).
Pure: the job parser calls it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from models.model_config import ConfigError, ModelConfig, RopeScaling
from models.spec import HFTensor

ROPE_TYPES = ("default", "linear", "llama3")

# [model] fields that are config.json keys of the same name and meaning in every Llama-style
# config (Mixtral's and Qwen2-MoE's too); LlamaConfig adds the two bias switches.
SHAPE_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "initializer_range",
)
_SAME = (*SHAPE_KEYS, "attention_bias", "mlp_bias")


def _positive(name: str, value: float) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be >= 1 (got {value})")


def validate(m: ModelConfig) -> None:
    if m.num_experts:
        raise ConfigError(f"model.num_experts needs model.family = \"moe\" (got {m.num_experts} "
                          f"experts for family {m.family!r})")
    if m.router_bias_update_rate:
        raise ConfigError("model.router_bias_update_rate needs model.family = \"moe\"")
    if m.qkv_bias or m.shared_expert_gate:
        # LlamaConfig has neither: an export would silently drop them.
        raise ConfigError("model.qkv_bias and model.shared_expert_gate need "
                          "model.family = \"moe\"")
    validate_shape(m)


def validate_shape(m: ModelConfig) -> None:
    """The checks of attention, norms, RoPE and the dense MLP (the moe family shares them)."""
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim"):
        _positive(f"model.{key}", getattr(m, key))
    if m.hidden_size % m.num_attention_heads and m.head_dim == m.hidden_size // m.num_attention_heads:
        raise ConfigError(
            f"model.num_attention_heads must divide model.hidden_size, or set model.head_dim "
            f"(got {m.num_attention_heads}, {m.hidden_size})"
        )
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(
            f"model.num_key_value_heads must divide model.num_attention_heads "
            f"(got {m.num_key_value_heads}, {m.num_attention_heads})"
        )
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim must be even for RoPE (got {m.head_dim})")
    if m.rms_norm_eps <= 0 or m.rope_theta <= 0 or m.initializer_range <= 0:
        raise ConfigError(
            "model.rms_norm_eps, model.rope_theta and model.initializer_range must be > 0"
        )
    r = m.rope_scaling
    if not (r.factor <= 1e6 and r.low_freq_factor <= 1e6 and r.high_freq_factor <= 1e6
            and r.original_max_position_embeddings <= 2**24):
        raise ConfigError("model.rope_scaling: factor, low_freq_factor and high_freq_factor "
                          "must be <= 1e6, original_max_position_embeddings <= 2**24")
    if r.rope_type != "default" and not r.factor > 0:
        raise ConfigError(f"model.rope_scaling.factor must be > 0 (got {r.factor})")
    if r.original_max_position_embeddings < 0:
        raise ConfigError("model.rope_scaling.original_max_position_embeddings must be >= 0 "
                          f"(got {r.original_max_position_embeddings})")
    if r.rope_type == "llama3" and not 0 < r.low_freq_factor < r.high_freq_factor:
        raise ConfigError(
            "model.rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor "
            f"(got {r.low_freq_factor}, {r.high_freq_factor})"
        )


def config_from_hf(hf: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """`[model]` fields (a TOML-shaped dict) from a Hugging Face Llama config.json."""
    if hf.get("model_type") != "llama":
        raise ConfigError(
            f"{source}: model_type must be \"llama\" for model.family \"llama\" "
            f"(got {hf.get('model_type')!r})"
        )
    return {"family": "llama", **shape_from_hf(hf, source, _SAME)}


def shape_from_hf(hf: Mapping[str, Any], source: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """The fields every Llama-style config.json shares: `keys` taken as they are, head_dim,
    and RoPE (transformers 4's `rope_theta` + `rope_scaling`, 5's `rope_parameters`)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act must be \"silu\" (got {hf['hidden_act']!r})")
    fields: dict[str, Any] = {}
    for key in keys:
        if hf.get(key) is not None:
            fields[key] = hf[key]
    fields.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    if hf.get("head_dim"):
        fields["head_dim"] = hf["head_dim"]
    elif isinstance(hf.get("hidden_size"), int) and isinstance(hf.get("num_attention_heads"), int):
        fields["head_dim"] = hf["hidden_size"] // max(1, hf["num_attention_heads"])
    # transformers 5: rope_parameters holds rope_theta and the scaling; 4: two top-level keys.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta")
    if theta is not None:
        fields["rope_theta"] = theta
    scaling: dict[str, Any] = {"rope_type": "default"}
    if rope:
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"{source}: rope_scaling.rope_type must be one of {', '.join(ROPE_TYPES)} "
                f"(got {rope_type!r})"
            )
        known = {f.name for f in dataclasses.fields(RopeScaling)}
        scaling = {"rope_type": rope_type}
        for key, value in rope.items():
            if key in known and value is not None:
                scaling[key] = value
            elif key not in ("partial_rotary_factor",) or value not in (None, 1, 1.0):
                raise ConfigError(f"{source}: rope_scaling.{key} is not supported (got {value!r})")
    fields["rope_scaling"] = scaling
    return fields


def config_to_hf(m: ModelConfig) -> dict[str, Any]:
    """config.json of `m` in the transformers 4 shape (`rope_theta`, `rope_scaling`), which
    transformers 5 reads too."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape_to_hf(m, _SAME),
        "pretraining_tp": 1,
    }


def shape_to_hf(m: ModelConfig, keys: tuple[str, ...]) -> dict[str, Any]:
    """The config.json keys every Llama-style config shares (`shape_from_hf`'s inverse)."""
    r = m.rope_scaling
    scaling = None
    if r.rope_type != "default":
        scaling = {"rope_type": r.rope_type, "factor": r.factor}
        if r.rope_type == "llama3":
            scaling |= {
                "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor,
                "original_max_position_embeddings":
                    r.original_max_position_embeddings or m.max_position_embeddings,
            }
    return {
        "hidden_act": "silu",
        **{key: getattr(m, key) for key in keys},
        "head_dim": m.head_dim,
        "rope_theta": m.rope_theta,
        "rope_scaling": scaling,
        "attention_dropout": 0.0,
        "use_cache": True,
    }


def to_hf(name: str) -> str:
    """Our parameter name → Hugging Face's (`LlamaForCausalLM` nests the decoder in `model`)."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def from_hf(name: str) -> str:
    if name.startswith("lm_head."):
        return name
    if not name.startswith("model."):
        raise ValueError(f"{name!r} is not a LlamaForCausalLM parameter name")
    return name.removeprefix("model.")


def hf_names(m: ModelConfig) -> list[str]:
    """Every tensor of a whole LlamaForCausalLM's weight files, in our module order."""
    layer = ["input_layernorm.weight"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        layer += [f"self_attn.{proj}.weight"] + ([f"self_attn.{proj}.bias"]
                                                 if m.attention_bias else [])
    layer.append("post_attention_layernorm.weight")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        layer += [f"mlp.{proj}.weight"] + ([f"mlp.{proj}.bias"] if m.mlp_bias else [])
    ours = ["embed_tokens.weight"]
    ours += [f"layers.{i}.{p}" for i in range(m.num_hidden_layers) for p in layer]
    ours.append("norm.weight")
    if not m.tie_word_embeddings:
        ours.append("lm_head.weight")
    return [to_hf(n) for n in ours]


def tensors(m: ModelConfig) -> list[HFTensor]:
    """Every file tensor of a LlamaForCausalLM: each one of our tensors under another name."""
    return [HFTensor(name, from_hf(name)) for name in hf_names(m)]
