"""Rotary position embeddings (Su et al. 2021) in the Llama "rotate half" convention."""

from __future__ import annotations

import torch


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim), computed in fp32."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim (got {head_dim})")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    positions = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate x of shape (batch, heads, seq, head_dim).

    `positions` (seq,) selects table rows, so a shard of a sequence (context parallelism)
    gets the angles of its global positions.
    """
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    else:
        cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin
