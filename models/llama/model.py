"""A plain single-device Llama (GQA, SwiGLU, RMSNorm, RoPE with Llama 3 scaling, optional
biases and tied embeddings): Llama 1-3.x, SmolLM, TinyLlama, Qwen2-shaped models without biases.

Parallelism is applied afterwards by `parallel.parallelize`; nothing here knows about meshes.
Module and parameter names follow Hugging Face's `LlamaForCausalLM` so weights map one to one.
The layers live in a ModuleDict keyed by index so that a pipeline stage that drops some layers
keeps the fully qualified names (and so the checkpoint keys) of the ones it keeps.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.model_config import ModelConfig
from ops.attention import attention
from ops.norm import RMSNorm
from ops.rotary import RopeScalingParams, apply_rotary, rotary_tables


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        h, q, kv = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                    cfg.num_key_value_heads * cfg.head_dim)
        qkv_bias = cfg.attention_bias or cfg.qkv_bias  # qkv_bias: Qwen2's, no o_proj bias
        self.q_proj = nn.Linear(h, q, bias=qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=cfg.attention_bias)
        # softmax(QK^T)V on (batch, heads, seq, head_dim); context parallelism swaps in ring
        # attention over its group (parallel.context_parallel).
        self.core: Callable[..., torch.Tensor] = attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v, causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg) for i in range(cfg.num_hidden_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Rotary tables are derived, not state: non-persistent, rebuilt by init_weights.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab).

        A pipeline stage may lack the embedding (it then receives hidden states) or the final
        norm and head (it then returns hidden states).
        """
        h = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str) -> None:
        cfg = self.cfg
        cos, sin = rotary_tables(
            cfg.max_position_embeddings, cfg.head_dim, cfg.rope_theta, torch.device(device),
            scaling=rope_scaling_of(cfg),
        )
        self.rope_cos, self.rope_sin = cos, sin


def rope_scaling_of(cfg: ModelConfig) -> RopeScalingParams:
    r = cfg.rope_scaling
    return RopeScalingParams(
        r.rope_type, r.factor, r.low_freq_factor, r.high_freq_factor,
        r.original_max_position_embeddings or cfg.max_position_embeddings,
    )


def _param_seed(seed: int, name: str) -> int:
    # crc32 is stable across processes and Python versions (hash() is salted per process).
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def tie_weights(model: Llama) -> None:
    """Tie the output projection to the embedding again, when the config ties them:
    materialising (to_empty) allocates each parameter anew and loses the tie. Values are not
    touched (a restore or `init_weights` gives them)."""
    if (
        model.cfg.tie_word_embeddings
        and model.lm_head is not None
        and model.embed_tokens is not None
    ):
        model.lm_head.weight = model.embed_tokens.weight


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """Initialise every parameter from (seed, its name) alone, whatever the layout.

    Each full tensor is drawn on CPU from a generator keyed by the parameter's fully qualified
    name, then the rank's shard is copied out of it, so dp=1 and dp=4 (or any TP/PP split)
    start from identical weights. Drawing full tensors costs one parameter's worth of host
    memory at a time, which is fine up to models whose largest matrix fits in host RAM.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    tie_weights(model)
    std = model.cfg.initializer_range
    for name, param in model.named_parameters():
        full_shape = param.shape
        if name.endswith("layernorm.weight") or name == "norm.weight":
            full = torch.ones(full_shape)
        elif name.endswith(".bias"):
            full = torch.zeros(full_shape)
        else:
            gen = torch.Generator().manual_seed(_param_seed(seed, name))
            full = torch.empty(full_shape).normal_(0.0, std, generator=gen)
        if isinstance(param, DTensor):
            # Every rank drew the same full tensor, so no broadcast is needed (src_data_rank=None).
            shard = distribute_tensor(
                full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
            )
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full.to(param.dtype))
    device = next(model.parameters()).device
    model.init_buffers(device if device.type != "meta" else "cpu")


def build_model(cfg: ModelConfig) -> Llama:
    """The model on the meta device: no memory until a layout materialises it."""
    with torch.device("meta"):
        return Llama(cfg)
