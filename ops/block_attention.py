"""Attention of some queries over one block of keys, with the log-sum-exp of each query row.

The building block of ring attention (ops.ring_attention): a query's softmax over all keys is
assembled from per-block partial results, so each block returns, besides its normalised
output, lse = log(sum_j exp(s_ij)) over the block's keys. The backward of a block takes the
*final* output and log-sum-exp of the rows (those of the whole sequence, not of this block):
P = exp(S - lse) is then the block's slice of the full softmax, and the block's dQ, dK, dV are
exactly its share of the full gradient (the FlashAttention-2 backward, block by block).

Tensors are (batch, heads, seq, head_dim); keys and values may have fewer heads than queries
(grouped-query attention, query head h reading KV head h // (heads / kv_heads)). `causal`
masks a block whose queries and keys are the same positions (key j visible to query i iff
j <= i); other blocks are either fully visible or not computed at all, which the caller decides.

Two implementations: `math` (fp32 matmuls, GQA without copying K/V; any device, the reference)
and `fused` (torch's flash-attention kernels, which return the log-sum-exp: the CUDA one for
fp16/bf16 inputs, and the CPU one, which tests use to check the wrapper). `block_forward` and
`block_backward` pick fused on CUDA in half precision, math otherwise.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# What the fused forward returns besides out and lse that its backward needs back (the CUDA
# kernel's random-number state, unused without dropout); empty for the math path and on CPU.
Extras = tuple[torch.Tensor, ...]


def _causal_mask(sq: int, sk: int, groups: int, device: torch.device) -> torch.Tensor:
    if sq != sk:
        raise ValueError(f"a causal block needs as many queries as keys (got {sq}, {sk})")
    # Rows are (group, query) flattened, so the (sq, sk) mask repeats once per query group.
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril().repeat(groups, 1)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, h, s, d) -> (b, kv_heads, (h // kv_heads) * s, d): query heads sharing a KV head
    become rows of one matrix, so one matmul per KV head serves them all."""
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    qg = _grouped(q.float(), k.shape[1])
    s = (qg @ k.float().transpose(-2, -1)) * scale
    if causal:
        mask = _causal_mask(q.shape[2], k.shape[2], q.shape[1] // k.shape[1], q.device)
        s = s.masked_fill(~mask, float("-inf"))
    return s


def math_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in fp32, lse in fp32 of shape (b, h, sq))."""
    b, h, sq, d = q.shape
    with torch.autocast(q.device.type, enabled=False):
        s = _scores(q, k, causal, scale)
        lse = s.logsumexp(dim=-1)
        out = torch.exp(s - lse.unsqueeze(-1)) @ v.float()
    return out.reshape(b, h, sq, v.shape[-1]), lse.reshape(b, h, sq)


def math_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in fp32 for this block, given the rows' final `out` and `lse`."""
    hk = k.shape[1]
    with torch.autocast(q.device.type, enabled=False):
        s = _scores(q, k, causal, scale)
        p = torch.exp(s - _grouped(lse.float().unsqueeze(-1), hk))
        do = _grouped(dout.float(), hk)
        # D_i = sum_j P_ij dP_ij = dout_i . out_i, from the final output of row i.
        delta = _grouped((dout.float() * out.float()).sum(-1, keepdim=True), hk)
        dv = p.transpose(-2, -1) @ do
        ds = p * (do @ v.float().transpose(-2, -1) - delta)
        dq = (ds @ k.float()) * scale
        dk = (ds.transpose(-2, -1) @ _grouped(q.float(), hk)) * scale
    return dq.reshape(q.shape), dk, dv


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_groups(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = dx.shape
    return dx.reshape(b, kv_heads, h // kv_heads, s, d).sum(2)


def fused_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, Extras]:
    """Torch's flash-attention forward (CUDA or CPU kernel): (out, lse, extras)."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    if q.is_cuda:
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1], (res[6], res[7])
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def fused_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    extras: Extras,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hk = k.shape[1]
    groups = q.shape[1] // hk
    kr, vr = _repeat_kv(k, groups), _repeat_kv(v, groups)
    dout, out, lse = dout.contiguous(), out.contiguous(), lse.contiguous()
    if q.is_cuda:
        empty = torch.empty(0, dtype=torch.int32, device=q.device)
        seed, offset = extras
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, kr, vr, out, lse, empty, empty, q.shape[2], k.shape[2], 0.0, causal,
            seed, offset, scale=scale,
        )  # fmt: skip
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, kr, vr, out, lse, 0.0, causal, scale=scale
        )
    return dq, _sum_groups(dk, hk), _sum_groups(dv, hk)


def use_fused(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, Extras]:
    """(out, lse in fp32, extras for `block_backward`)."""
    if use_fused(q):
        out, lse, extras = fused_forward(q, k, v, causal, scale)
        return out, lse.float(), extras
    out, lse = math_forward(q, k, v, causal, scale)
    return out, lse, ()


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    extras: Extras,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block; accumulate them in fp32."""
    if use_fused(q):
        return fused_backward(dout, q, k, v, out.to(q.dtype), lse, causal, scale, extras)
    return math_backward(dout, q, k, v, out, lse, causal, scale)
