"""Ring attention over a context-parallel process group, for zig-zag sharded sequences.

Each of the cp ranks holds the queries, keys and values of its share of the sequence. Keys and
values travel once around the ring (rank r sends to r + 1, receives from r - 1), so after cp - 1
hops every rank has seen every block; each block's partial attention is folded into the
running output with the online softmax (the running log-sum-exp of each query row). The next
block's transfer is posted before the current block is computed, so communication overlaps
compute. Backward sends the blocks around again, and with each block an accumulator of its
dK and dV: every rank adds its queries' contribution and passes it on, and after cp hops the
accumulator is back with the rank that owns the block (docs/context_parallel.md).

The sequence layout is zig-zag (parallel.context_parallel): of 2·cp equal chunks, rank r holds
chunks r and 2·cp − 1 − r, in that order. Under a causal mask that gives each step the same
amount of work on every rank: the rank's own block is causal over its two chunks, a block from
a lower rank is seen in full by all local queries through its first chunk only, and a block from
a higher rank is seen in full by the local second chunk only. Every rank computes the same
number of score entries at every step, so no rank waits for another at the ring's hops.

Key and value gradients are accumulated and sent in fp32 whatever the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ops.block_attention import Extras, block_backward, block_forward

ALL = slice(None)


@dataclass(frozen=True)
class Ring:
    """A process group seen as a ring: this rank's position and the group's size."""

    group: dist.ProcessGroup
    rank: int
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> Ring:
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def shift(self, tensor: torch.Tensor, tag: int) -> Callable[[], torch.Tensor]:
        """Post: send `tensor` to the next rank, receive the previous rank's into a new buffer.

        Returns the function that waits for both and gives the received tensor. `tensor` must
        not change until then. One message per tag is in flight at a time.
        """
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(
                    dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.size,
                    tag=tag,
                ),
                dist.P2POp(
                    dist.irecv, received, group=self.group,
                    group_peer=(self.rank - 1) % self.size, tag=tag,
                ),
            ]
        )  # fmt: skip

        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            return received

        return wait


def _block(rank: int, src: int, chunk: int, causal: bool) -> tuple[slice, slice, bool]:
    """Which local query rows see which keys of `src`'s block, and whether causally masked.

    Query chunks (rank, 2·cp−1−rank) against key chunks (src, 2·cp−1−src): a chunk sees an
    earlier chunk in full, its own chunk causally, a later chunk not at all.
    """
    if not causal:
        return ALL, ALL, False
    if src == rank:
        return ALL, ALL, True
    if src < rank:
        return ALL, slice(0, chunk), False
    return slice(chunk, None), ALL, False


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running ones, in place (online softmax)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: Ring,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        chunk = q.shape[2] // 2
        kv = torch.stack([k, v])
        out = lse = None
        extras: Extras = ()
        for step in range(ring.size):
            pending = ring.shift(kv, tag=0) if step < ring.size - 1 else None
            src = (ring.rank - step) % ring.size
            rows, cols, masked = _block(ring.rank, src, chunk, causal)
            block_out, block_lse, block_extras = block_forward(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], masked, scale
            )
            if step == 0:  # the rank's own block covers every query row
                # Copies: the running sums are updated in place, and the kernel's results may
                # be held elsewhere (selective recompute caches matmul outputs).
                out = block_out.to(torch.float32, copy=True)
                lse, extras = block_lse.clone(), block_extras
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if pending is not None:
                kv = pending()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale, ctx.extras = ring, causal, scale, extras
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        chunk = q.shape[2] // 2
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        for step in range(ring.size):
            pending = ring.shift(kv, tag=1) if step < ring.size - 1 else None
            src = (ring.rank - step) % ring.size
            rows, cols, masked = _block(ring.rank, src, chunk, ctx.causal)
            dq_b, dk_b, dv_b = block_backward(
                dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                out[:, :, rows], lse[:, :, rows], masked, ctx.scale, ctx.extras,
            )  # fmt: skip
            dq[:, :, rows] += dq_b
            dkv[0][:, :, cols] += dk_b
            dkv[1][:, :, cols] += dv_b
            # The accumulator of src's block moves on with the block; after the last step it
            # reaches the rank after this one, whose block it is.
            passed = ring.shift(dkv, tag=2) if ring.size > 1 else None
            if pending is not None:
                kv = pending()
            if passed is not None:
                dkv = passed()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole ring's keys and values.

    q: (batch, heads, 2·chunk, head_dim), k and v: (batch, kv_heads, 2·chunk, head_dim), each
    rank's two zig-zag chunks (module docstring). Returns this rank's output rows.
    """
    if q.shape[2] % 2 or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"ring attention needs an even local sequence, the same for q and k/v "
            f"(got {q.shape[2]}, {k.shape[2]})"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"kv heads must divide query heads (got {k.shape[1]}, {q.shape[1]})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, ring, causal, scale)
