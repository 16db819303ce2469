"""Context parallelism (the playbook's "Context Parallelism" section): the sequence split over cp.

The cp ranks of one data-parallel replica read the same samples and each keeps a share of
every sequence; everything but attention is per token, so only attention needs the other
ranks' tokens, and it gets them by ring attention (ops.ring_attention) over the mesh's cp dim.

Zig-zag (head-tail) sharding: the sequence is cut into 2·cp equal chunks and rank r keeps
chunks r and 2·cp − 1 − r. Under a causal mask late tokens attend to more keys than early
ones; pairing an early chunk with a late one gives every rank the same attention work (with
contiguous shards the last rank would do about 2·cp − 1 times the first rank's work; the
playbook's "Context Parallelism" section, zig-zag ring attention).

What changes, applied by `apply_context_parallel` to the single-device model:
- each Attention's core becomes ring attention on the cp group;
- each Attention gets the RoPE rows of its tokens' global positions (a forward pre-hook that
  selects them from the model's tables), so rotations are those of the unsharded sequence;
- the data (trainer.data.step_micro_batches) gives each rank its zig-zag share of inputs and
  targets. The loss needs no change: each rank sums its tokens' losses and divides by the
  step's global token count, and gradients are summed over dp × cp (parallel.mesh.data_mesh).
- the moe family's per-sequence balancing loss (models.moe.aux_loss) sums its expert counts
  over the cp group, so each rank's share adds up to the whole sequences' loss.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ops.ring_attention import Ring, ring_attention


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by cp rank `rank`, in local order: chunks rank and 2·cp−1−rank."""
    if seq_len % (2 * cp):
        raise ValueError(f"zig-zag sharding needs seq_len to be a multiple of 2 x cp (got {seq_len}, cp {cp})")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([head, tail])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's zig-zag share of `x` along `dim` (the sequence)."""
    if cp == 1:
        return x
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp, rank).to(x.device))


class RingCore:
    """An Attention's core under context parallelism: ring attention on the cp group."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
    ) -> torch.Tensor:
        return ring_attention(q, k, v, self.ring, causal)


class GlobalRotary:
    """Forward pre-hook of an Attention: RoPE tables cut to this rank's global positions.

    The model passes its (max_positions, head_dim) tables and rotates the first `seq` rows;
    after this hook those rows are the ones of the rank's zig-zag positions. The local sequence
    length is read from the input (a tp-sharded DTensor under sequence parallelism still has
    the rank's whole cp share as its global length).
    """

    def __init__(self, cp: int, rank: int) -> None:
        self.cp, self.rank = cp, rank
        self._positions: dict[tuple[int, torch.device], torch.Tensor] = {}

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        key = (local_len, device)
        if key not in self._positions:
            pos = zigzag_positions(local_len * self.cp, self.cp, self.rank)
            self._positions[key] = pos.to(device)
        return self._positions[key]

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        x, cos, sin = args
        pos = self.positions(x.shape[1], cos.device)
        return x, cos[pos], sin[pos]


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Make every attention layer of `model` context-parallel over `cp_mesh` (no-op at cp 1)."""
    if cp_mesh.size() == 1:
        return
    ring = Ring.of(cp_mesh.get_group())
    for block in model.layers.values():
        attn = block.self_attn
        attn.core = RingCore(ring)
        attn.register_forward_pre_hook(GlobalRotary(ring.size, ring.rank))
    router_aux = getattr(model, "router_aux", None)
    if router_aux is not None:
        router_aux.shard_sequences(cp_mesh.get_group(), cp_mesh.size())
