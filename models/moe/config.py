"""The moe family's `[model]` checks (pure: the job parser calls them).

Attention, norms and RoPE are Llama's (models/llama/config.py); the MLP of a layer is either
Llama's dense SwiGLU or a routed mixture of `num_experts` SwiGLU experts (docs/moe.md).
"""

from __future__ import annotations

from models.llama.config import validate_shape
from models.model_config import ConfigError, ModelConfig


def expert_size(m: ModelConfig) -> int:
    """One expert's MLP width."""
    return m.moe_intermediate_size or m.intermediate_size


def is_moe_layer(m: ModelConfig, index: int) -> bool:
    """Layer `index` (0-based) routes over experts: DeepSeek's rule, first_k_dense_replace dense
    layers, then every moe_layer_freq-th layer."""
    return index >= m.first_k_dense_replace and index % m.moe_layer_freq == 0


def moe_layers(m: ModelConfig) -> list[int]:
    return [i for i in range(m.num_hidden_layers) if is_moe_layer(m, i)]


def validate(m: ModelConfig) -> None:
    validate_shape(m)
    if m.num_experts < 1:
        raise ConfigError(f"model.num_experts must be >= 1 for model.family \"moe\" "
                          f"(got {m.num_experts})")
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        raise ConfigError(f"model.num_experts_per_tok must be in [1, model.num_experts] "
                          f"(got {m.num_experts_per_tok}, {m.num_experts} experts)")
    if m.moe_intermediate_size < 0 or m.num_shared_experts < 0 or m.first_k_dense_replace < 0:
        raise ConfigError("model.moe_intermediate_size, num_shared_experts and "
                          "first_k_dense_replace must be >= 0")
    if m.moe_layer_freq < 1:
        raise ConfigError(f"model.moe_layer_freq must be >= 1 (got {m.moe_layer_freq})")
    if not moe_layers(m):
        raise ConfigError(
            f"model: no layer is a mixture of experts (num_hidden_layers {m.num_hidden_layers}, "
            f"first_k_dense_replace {m.first_k_dense_replace}, moe_layer_freq {m.moe_layer_freq})"
        )
    if m.router_aux_loss_coef < 0:
        raise ConfigError(f"model.router_aux_loss_coef must be >= 0 (got {m.router_aux_loss_coef})")
    if m.router_bias_update_rate < 0:
        raise ConfigError(f"model.router_bias_update_rate must be >= 0 "
                          f"(got {m.router_bias_update_rate})")
    if m.mlp_bias:
        raise ConfigError("model.mlp_bias is not supported by model.family \"moe\"")
    if m.shared_expert_gate and not m.num_shared_experts:
        raise ConfigError("model.shared_expert_gate needs model.num_shared_experts >= 1 (it "
                          "scales the shared experts' output)")
