"""Fixed-point sums (parallel.exact_sum) and the gradient accumulator (parallel.reproducible),
in one process: the same bits in any order and any split, within the documented bound."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from models.moe.model import Experts
from parallel.exact_sum import (
    ceil_log2,
    dequantize,
    exact_slot_sum,
    exact_squared_norm,
    exponent,
    quantize,
    shift_for,
)
from parallel.reproducible import HEADROOM_BITS, ExactGradients, _Region

pytestmark = pytest.mark.unit


def _terms(n: int, size: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes over 30 binary orders, so fp32 sums round differently in each order.
    return [
        torch.randn(size, generator=gen)
        * torch.exp2(torch.randint(-30, 0, (size,), generator=gen).float())
        for _ in range(n)
    ]


def test_helpers():
    assert [ceil_log2(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    assert exponent(1.0) == 1 and exponent(0.75) == 0 and exponent(-3.0) == 2
    assert shift_for(0, 8) == 59
    x = torch.tensor([0.5, -0.25, 3.0, 1e-30])
    q = quantize(x, 10)
    assert q.dtype == torch.int64 and q.tolist() == [512, -256, 3072, 0]
    assert torch.equal(dequantize(q, 10, torch.float32), torch.tensor([0.5, -0.25, 3.0, 0.0]))
    # A shift outside fp32's exponent range goes through fp64, still exact.
    assert quantize(torch.tensor([2.0**-140]), 150).item() == 2**10


def test_fixed_point_sum_is_order_free_and_within_bound():
    terms = _terms(8, 4096, 0)
    largest = max(float(t.abs().max()) for t in terms)
    shift = shift_for(exponent(largest) + HEADROOM_BITS, len(terms))
    orders = ([0, 1, 2, 3, 4, 5, 6, 7], [7, 3, 5, 1, 0, 6, 2, 4])
    sums = []
    for order in orders:
        acc = torch.zeros(4096, dtype=torch.int64)
        for i in order:
            acc += quantize(terms[i], shift)
        sums.append(dequantize(acc, shift, torch.float32))
    assert torch.equal(sums[0], sums[1])
    exact = torch.tensor(
        [math.fsum(float(t[j]) for t in terms) for j in range(4096)], dtype=torch.float64
    )
    # docs/reproducible.md: |error| <= T/2 quanta before the final fp32 rounding.
    bound = len(terms) * math.ldexp(1.0, -shift) / 2
    err = (sums[0].double() - exact).abs()
    assert bool((err <= bound + exact.abs() * 2.0**-24).all())
    # fp32 summation in the two orders differs somewhere (the problem this solves).
    fp32 = [sum((terms[i] for i in order), torch.zeros(4096)) for order in orders]
    assert not torch.equal(fp32[0], fp32[1])


def test_squared_norm_does_not_depend_on_the_split():
    (flat,) = _terms(1, 10_001, 1)
    whole = exact_squared_norm([flat], None, flat.numel())
    pieces = exact_squared_norm(list(torch.split(flat, [3, 5000, 4998])), None, flat.numel())
    assert whole == pieces
    exact = math.fsum(float(v) ** 2 for v in flat.double())
    assert whole == pytest.approx(exact, rel=1e-15)
    assert exact_squared_norm([torch.zeros(3)], None, 3) == 0.0


def test_slot_sum_keeps_values():
    assert exact_slot_sum(torch.tensor([0.1, 0.0, 2.5]), None) == pytest.approx([0.1, 0.0, 2.5])


@pytest.mark.parametrize(("rows", "size"), [(7, 3), (2, 4), (8, 4), (1, 1), (5, 2)])
@pytest.mark.parametrize("dim", [0, 1])
def test_region_splits_like_torch_chunk(rows, size, dim):
    """dim 1: ZeRO-1 slices routed experts (ep-sharded on dim 0) on their dim 1."""
    shape = [4, rows, 2] if dim else [rows, 3]
    cols = math.prod(shape) // rows
    region = _Region("w", torch.Size(shape), 2, rows, cols, -(-rows // size), dim)
    width = 2 + region.chunk * cols
    buffer = torch.zeros(size, width, dtype=torch.int64)
    values = torch.arange(1, rows * cols + 1, dtype=torch.int64).view(shape)
    region.add(buffer, values)
    chunks = torch.chunk(values, size, dim=dim)
    for rank in range(size):
        expected = chunks[rank] if rank < len(chunks) else values.narrow(dim, 0, 0)
        assert torch.equal(region.local(buffer[rank], rank), expected)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3, bias=False)
        self.b = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _accumulate(model: _Tiny, batches: list[torch.Tensor], exact: ExactGradients) -> int:
    exponents = None
    for attempt in range(2):
        exact.begin(exponents)
        for x in batches:
            model(x).sum().backward()
            exact.micro_batch_done()
        exponents = exact.settle()
        if exponents is None:
            return attempt
    raise AssertionError("the second attempt must fit")


def test_accumulator_is_order_free_and_retries_past_its_headroom():
    torch.manual_seed(0)
    model = _Tiny()
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(2, 4, generator=gen) for _ in range(4)]
    exact = ExactGradients(model, None, micro_batches=4)
    assert _accumulate(model, batches, exact) == 0
    first = exact.reduce()
    assert all(p.grad is None for p in model.parameters())  # taken from autograd
    # Micro-batch 0 fixes the scale; the rest may come in any order.
    assert _accumulate(model, [batches[0], *reversed(batches[1:])], exact) == 0
    assert all(torch.equal(a, b) for a, b in zip(first, exact.reduce(), strict=True))
    assert torch.allclose(_flat(first), _fp32_sum(model, batches), rtol=1e-6)
    # A micro-batch far above micro-batch 0's range: the step runs again on the range of the
    # step's maxima, and still sums the same gradients.
    big = [batches[0], batches[1] * 2.0 ** (HEADROOM_BITS + 4), batches[2]]
    assert _accumulate(model, big, exact) == 1
    assert torch.allclose(_flat(exact.reduce()), _fp32_sum(model, big), rtol=1e-6)


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _fp32_sum(model: nn.Module, batches: list[torch.Tensor]) -> torch.Tensor:
    # autograd.grad accumulates into no parameter, so the accumulator's hooks stay out of it.
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for x in batches:
        for t, g in zip(total, torch.autograd.grad(model(x).sum(), params), strict=True):
            t += g
    return _flat(total)


def test_experts_hand_over_each_sources_gradients():
    """parallel.reproducible under ep: with a gradient sink, Experts runs each (source, expert)
    block on its own, as that source's micro-batch runs alone, and hands each source's weight
    gradients over apart instead of adding them in fp32."""
    torch.manual_seed(0)
    experts = Experts(2, 4, 3)
    for p in experts.parameters():
        nn.init.normal_(p)
    counts = [[2, 1], [0, 3]]  # [source][local expert], rows source-major
    rows = torch.randn(6, 4)
    got: dict[int, tuple[torch.Tensor, ...]] = {}
    experts.gradient_sink = lambda source, grads: got.setdefault(source, grads)
    out = experts(rows, [c for per_source in counts for c in per_source], sources=2)
    out.square().sum().backward()
    assert all(p.grad is None for p in experts.parameters()) and sorted(got) == [0, 1]
    experts.gradient_sink = None
    start = 0
    for source, per_source in enumerate(counts):
        mine = slice(start, start + sum(per_source))
        alone = experts(rows[mine], per_source)
        assert torch.equal(alone, out[mine])
        grads = torch.autograd.grad(alone.square().sum(), list(experts.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(got[source], grads, strict=True))
        start = mine.stop
