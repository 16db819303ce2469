"""The job spec's `[model]` section and the error every field of the spec raises.

Here, below both the families (models/<family>/config.py checks its own fields) and the rest of
the spec (parallel/job.py, which re-exports these names), so that `models` imports nothing of
`parallel`. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """A job spec problem, always naming the field (`section.key`)."""


@dataclass(frozen=True)
class RopeScaling:
    """Hugging Face's `rope_scaling` (`rope_parameters` in transformers 5): how RoPE frequencies
    are stretched for long contexts (ops/rotary.py). `original_max_position_embeddings` 0 means
    `model.max_position_embeddings`."""

    rope_type: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """The model: a family registered in `models` and its fields, named as Hugging Face's
    config of that family (`LlamaConfig` for "llama"); each family checks its own."""

    family: str = "llama"
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    # 0: hidden_size / num_attention_heads (resolved on construction, as LlamaConfig does).
    head_dim: int = 0
    vocab_size: int = 256
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    # q, k and v biases without o_proj's (Qwen2-MoE's `qkv_bias`); attention_bias: all four.
    qkv_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # Mixture of experts (family "moe", models/moe; docs/moe.md). 0 experts: every MLP dense.
    num_experts: int = 0  # routed experts per MoE layer (Mixtral's num_local_experts)
    num_experts_per_tok: int = 2  # top-k
    moe_intermediate_size: int = 0  # one expert's MLP width; 0: intermediate_size
    num_shared_experts: int = 0  # experts every token passes through (DeepSeek's n_shared_experts)
    first_k_dense_replace: int = 0  # the first k layers keep a dense MLP (DeepSeek's name)
    moe_layer_freq: int = 1  # of the others, layer i is MoE when i % moe_layer_freq == 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    # Scale the shared experts' output by sigmoid(x · w), w an h -> 1 linear (Qwen2-MoE's).
    shared_expert_gate: bool = False
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss (0: off)
    # DeepSeek-V3's auxiliary-loss-free balancing: per-expert routing bias step (0: off).
    router_bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
