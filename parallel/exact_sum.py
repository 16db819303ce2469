"""Exact, order-independent sums of floating-point numbers by 64-bit fixed point.

Floating-point addition is not associative: summing the same gradients over 2 ranks or over 3
rounds differently. Integer addition is associative, so converting every term to an integer
multiple of one quantum 2**-shift, summing the integers (in any order, over any ranks) and
converting back gives the same bits whatever the order. docs/reproducible.md derives the
error bound against an fp32 sum.

The shift is chosen so that `terms` values, each below 2**exponent in magnitude, cannot
overflow an int64 sum: each is below 2**(SUM_BITS - ceil(log2 terms)) once scaled.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

SUM_BITS = 62  # magnitude bits of a sum: int64 keeps one bit for the sign and one spare


def ceil_log2(n: int) -> int:
    return max(0, (n - 1).bit_length())


def exponent(value: float) -> int:
    """The least integer e with |value| < 2**e (value finite and non-zero)."""
    return math.frexp(value)[1]


def shift_for(value_exponent: int, terms: int) -> int:
    """The fixed-point shift for `terms` values below 2**value_exponent."""
    return SUM_BITS - ceil_log2(terms) - value_exponent


def quantize(x: torch.Tensor, shift: int) -> torch.Tensor:
    """round(x * 2**shift) as int64 (half to even).

    Scaling by a power of two is exact, in fp32 while 2**shift is a normal fp32 number and in
    fp64 otherwise (an fp64 `x` stays fp64), so the only rounding is to the integer grid.
    """
    narrow = x.dtype != torch.float64 and -126 <= shift <= 127
    wide = x.float() if narrow else x.double()
    return (wide * math.ldexp(1.0, shift)).round_().to(torch.int64)


def dequantize(q: torch.Tensor, shift: int, dtype: torch.dtype) -> torch.Tensor:
    """q * 2**-shift, rounded to `dtype` (through fp64: exact while |q| < 2**53)."""
    return (q.double() * math.ldexp(1.0, -shift)).to(dtype)


def exact_squared_norm(
    pieces: list[torch.Tensor], group: dist.ProcessGroup | None, total_numel: int
) -> float:
    """Sum of squares of every element of `pieces` on every rank of `group`.

    Each square is exact in fp64 (24-bit mantissas square into 48 bits). The squares become
    fixed point on the scale of the largest one anywhere (an all-reduce MAX), in two int64
    limbs of `limb` bits each, since `total_numel` terms (far more than a gradient sum's
    micro-batches) would leave one int64 too few bits; both limb sums are all-reduced and
    joined in Python's exact integers. The result does not depend on how the elements are split
    over ranks or tensors.
    """
    local = max((float(p.detach().abs().amax()) for p in pieces if p.numel()), default=0.0)
    largest = torch.tensor([local * local], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    top = float(largest.item())
    if top == 0.0 or not math.isfinite(top):
        return top
    limb = SUM_BITS - ceil_log2(total_numel)  # bits per limb, so N limbs cannot overflow
    shift = 2 * limb - exponent(top)  # every scaled square is below 2**(2 * limb)
    sums = torch.zeros(2, dtype=torch.int64)
    for p in pieces:
        if not p.numel():
            continue
        scaled = p.detach().double().square() * math.ldexp(1.0, shift)  # exact
        high = torch.floor(scaled * math.ldexp(1.0, -limb))
        low = torch.round(scaled - high * math.ldexp(1.0, limb))  # exact before the rounding
        sums[0] += high.to(torch.int64).sum().cpu()
        sums[1] += low.to(torch.int64).sum().cpu()
    if group is not None:
        dist.all_reduce(sums, group=group)
    high_sum, low_sum = (int(v) for v in sums.tolist())
    return math.ldexp(float((high_sum << limb) + low_sum), -shift)


def exact_slot_sum(slots: torch.Tensor, group: dist.ProcessGroup | None) -> list[float]:
    """Values that each live on one rank, in a slot of their own (zeros elsewhere), on every rank.

    Adding zeros is exact, so the all-reduce SUM returns every rank's values unchanged, in slot
    order; callers then sum them exactly (math.fsum) or in that order.
    """
    slots = slots.to(torch.float64)
    if group is not None:
        dist.all_reduce(slots, group=group)
    return slots.tolist()
