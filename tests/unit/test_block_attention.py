"""Per-block attention with log-sum-exp (ops.block_attention) and zig-zag sharding, in process."""

from __future__ import annotations

import math

import pytest
import torch

from ops.attention import attention_math
from ops.block_attention import fused_backward, fused_forward, math_backward, math_forward
from parallel.context_parallel import shard_sequence, zigzag_positions

pytestmark = pytest.mark.unit

SHAPES = [
    pytest.param(4, 4, id="mha"),
    pytest.param(4, 2, id="gqa"),
    pytest.param(4, 1, id="mqa"),
]


def _inputs(heads: int, kv_heads: int, seq: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, 8, generator=gen)
    k = torch.randn(2, kv_heads, seq, 8, generator=gen)
    v = torch.randn(2, kv_heads, seq, 8, generator=gen)
    dout = torch.randn(2, heads, seq, 8, generator=gen)
    return q, k, v, dout


def _reference(q, k, v, dout, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_math(*leaves, causal=causal)
    out.backward(dout)
    return out.detach(), *(t.grad for t in leaves)


@pytest.mark.parametrize(("heads", "kv_heads"), SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_math_block_is_attention_with_its_gradient(heads, kv_heads, causal):
    q, k, v, dout = _inputs(heads, kv_heads)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, causal)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = math_forward(q, k, v, causal, scale)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    n_rep = heads // kv_heads
    scores = (q @ k.repeat_interleave(n_rep, 1).transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-5, atol=1e-6)
    dq, dk, dv = math_backward(dout, q, k, v, out, lse, causal, scale)
    for got, want in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_blocks_of_keys_merge_into_the_full_softmax():
    """Two halves of the keys, merged by their log-sum-exp, give attention over all keys; each
    half's backward with the merged out and lse gives its share of the full gradient."""
    q, k, v, dout = _inputs(4, 2)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, causal=False)
    scale = 1 / math.sqrt(q.shape[-1])
    halves = [slice(0, 6), slice(6, 12)]
    parts = [math_forward(q, k[:, :, h], v[:, :, h], False, scale) for h in halves]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * torch.exp(part_lse - lse).unsqueeze(-1) for o, part_lse in parts)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    dq = torch.zeros_like(q)
    for h in halves:
        dq_h, dk_h, dv_h = math_backward(dout, q, k[:, :, h], v[:, :, h], out, lse, False, scale)
        dq += dq_h
        torch.testing.assert_close(dk_h, ref_dk[:, :, h], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dv_h, ref_dv[:, :, h], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dq, ref_dq, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads"), SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_fused_kernel_wrapper_matches_math(heads, kv_heads, causal):
    """The fused path (torch's CPU flash kernel here, the CUDA one on GPUs) is wrapped for GQA
    and takes the final out and lse in backward exactly as the math path does."""
    q, k, v, dout = _inputs(heads, kv_heads)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = math_forward(q, k, v, causal, scale)
    f_out, f_lse, extras = fused_forward(q, k, v, causal, scale)
    torch.testing.assert_close(f_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f_lse, lse, rtol=1e-5, atol=1e-6)
    want = math_backward(dout, q, k, v, out, lse, causal, scale)
    got = fused_backward(dout, q, k, v, f_out, f_lse, causal, scale, extras)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_positions_cover_the_sequence_with_equal_causal_work(cp):
    seq = 8 * cp
    shards = [zigzag_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    for r, pos in enumerate(shards):
        chunk = seq // (2 * cp)
        assert pos[:chunk].tolist() == list(range(r * chunk, (r + 1) * chunk))
        assert pos[chunk:].tolist() == list(range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))
    # Causal work of a rank: keys visible to its queries, sum over queries of (position + 1).
    work = {int((pos + 1).sum()) for pos in shards}
    assert len(work) == 1, work
    x = torch.arange(2 * seq).reshape(2, seq)
    assert torch.equal(shard_sequence(x, cp, cp - 1), x[:, shards[-1]])


def test_zigzag_needs_two_chunks_per_rank():
    with pytest.raises(ValueError, match="multiple of 2 x cp"):
        zigzag_positions(12, 4, 0)
