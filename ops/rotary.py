"""Rotary position embeddings (Su et al. 2021) in the Llama "rotate half" convention."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class RopeScalingParams(NamedTuple):
    """How the frequencies are stretched for contexts beyond the pretraining one (Hugging Face's
    `rope_scaling` names): "default" none, "linear" all divided by `factor` (position
    interpolation, Chen et al. 2023), "llama3" Llama 3.1's: wavelengths shorter than
    original_max_position_embeddings / high_freq_factor kept, longer than
    original / low_freq_factor divided by `factor`, those between blended smoothly."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


NO_SCALING = RopeScalingParams()


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScalingParams = NO_SCALING,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The head_dim / 2 rotation frequencies, in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    if scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        raise ValueError(f"unknown rope_type {scaling.rope_type!r}")
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device | None = None,
    scaling: RopeScalingParams = NO_SCALING,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim), computed in fp32."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim (got {head_dim})")
    inv_freq = inverse_frequencies(head_dim, theta, scaling, device)
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
