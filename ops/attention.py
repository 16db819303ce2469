"""Causal attention with one entry point and three implementations.

`attention` dispatches to flash-attn when it is importable and the tensors are on CUDA in
fp16/bf16, else to torch's `scaled_dot_product_attention`. `attention_math` is the plain
reference the tests compare against. All take (batch, heads, seq, head_dim) tensors; key/value
may have fewer heads (grouped-query attention).
"""

from __future__ import annotations

import importlib.util
import math
from functools import cache

import torch
import torch.nn.functional as F


@cache
def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def attention_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[-2], k.shape[-2]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), is_causal=causal
    )


def attention_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    from flash_attn import flash_attn_func

    # flash-attn wants (batch, seq, heads, head_dim) and handles GQA itself. Its backward
    # accumulates dQ with atomics unless asked to be deterministic (parallel.reproducible turns
    # torch's deterministic mode on).
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                          deterministic=torch.are_deterministic_algorithms_enabled())
    return out.transpose(1, 2)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_available():
        return attention_flash(q, k, v, causal)
    return attention_sdpa(q, k, v, causal)
