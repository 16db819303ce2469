"""Which source each global sample comes from: a pure function of (seed, i, weights).

Sample i is given the golden-ratio point `u_i = (i·A + S) mod 2^64` (A = round(2^64/φ), S drawn
from the seed) and goes to source k when u_i falls in k's slice of [0, 2^64), a slice as wide as
k's share of the weights. The points i·φ mod 1 are the most evenly spread sequence there is
(the three-distance theorem): in any run of n consecutive samples every source's count is within
a few samples of n·share, so a source's share converges to its weight deterministically rather
than by the law of large numbers, at any starting sample (a resumed job's first step included).

The position of sample i within its source (how many earlier samples went to the same source) is
a count of lattice points under a line, which `floor_sum` computes exactly in O(log 2^64) steps,
so any sample is found without replaying the ones before it: the stream does not depend on the
world size and resumes exactly after any resize. All arithmetic is on Python integers, and the
slices are cut with exact fractions of the float weights: every platform agrees to the bit.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

MODULUS = 2**64
GOLDEN = 0x9E3779B97F4A7C15  # round(2^64 / φ), odd
# Tags the seed sequence of the blend offset, so it is not the seed of any source permutation.
_OFFSET_STREAM = 0xB1E4D


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum(floor((a·i + b) / m) for i in range(n)), for n, a, b >= 0 and m >= 1, in O(log m)."""
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = divmod(y_max, m)
        m, a = a, m


class Blend:
    """Source and in-source position of every global sample, for relative `weights` (> 0)."""

    def __init__(self, weights: Sequence[float], seed: int) -> None:
        if not weights or any(not w > 0 for w in weights):
            raise ValueError(f"blend weights must be > 0 (got {list(weights)})")
        exact = [Fraction(w) for w in weights]
        total = sum(exact)
        cumulative = Fraction(0)
        self.bounds = [0]
        for w in exact:
            cumulative += w
            self.bounds.append(int(cumulative * MODULUS // total))
        self.offset = int(np.random.PCG64([seed, _OFFSET_STREAM]).random_raw())

    def _point(self, index: int) -> int:
        return (index * GOLDEN + self.offset) % MODULUS

    def _below(self, n: int, t: int) -> int:
        """How many of samples [0, n) have their point below t (0 <= t <= 2^64).

        [x mod M < t] = floor(x/M) - floor((x - t)/M), and the second term is shifted by M to
        keep floor_sum's arguments non-negative.
        """
        s = self.offset
        return (
            floor_sum(n, MODULUS, GOLDEN, s) - floor_sum(n, MODULUS, GOLDEN, s - t + MODULUS) + n
        )

    def counts(self, n: int) -> list[int]:
        """How many of samples [0, n) each source gives."""
        below = [self._below(n, t) for t in self.bounds]
        return [below[k + 1] - below[k] for k in range(len(below) - 1)]

    def source(self, index: int) -> int:
        return bisect.bisect_right(self.bounds, self._point(index)) - 1

    def origin(self, index: int) -> tuple[int, int]:
        """(source, position within the source) of global sample `index`."""
        k = self.source(index)
        return k, self._below(index, self.bounds[k + 1]) - self._below(index, self.bounds[k])
