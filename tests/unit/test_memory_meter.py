"""The activation counter of trainer/memory_meter.py: peak bytes of saved tensors, by storage."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainer.memory_meter import SavedTensorCounter, storage_bytes  # noqa: E402

pytestmark = pytest.mark.unit


def test_saved_tensors_peak_is_counted_once_per_storage_and_released_by_backward() -> None:
    counter = SavedTensorCounter()
    w = torch.nn.Parameter(torch.ones(8, 8))
    x = torch.ones(4, 8, requires_grad=True)
    with counter.track():
        h = x * 2  # saves nothing (the factor is a constant)
        y = h.sin()  # saves h: 4 x 8 fp32
        z = h.cos()  # saves h again: the same storage, counted once
        out = (y @ w + z.exp()).sum()  # y (w is a parameter, skipped) and exp's output
    assert counter.peak == counter.live == 3 * 4 * 8 * 4
    out.backward()
    del y, z, out
    assert counter.live == 0
    assert counter.peak == 3 * 4 * 8 * 4


def test_a_view_costs_its_whole_storage_and_the_peak_restarts_from_what_is_live() -> None:
    counter = SavedTensorCounter()
    x = torch.ones(10, 10, requires_grad=True)
    with counter.track():
        y = (x * 1).view(100)[:10].sin()  # saves a 10-element view of a 100-element storage
    assert counter.peak == 100 * 4
    counter.reset()
    assert counter.peak == counter.live == 100 * 4
    y.sum().backward()
    assert counter.live == 0


def test_storage_bytes_deduplicates_and_skips_none() -> None:
    a = torch.zeros(16)
    assert storage_bytes([a, a[:4], None, torch.zeros(2, dtype=torch.float64)]) == 64 + 16


def test_a_step_that_raises_leaves_no_tensor_in_what_autograd_still_holds() -> None:
    """The graph of an abandoned step may outlive it (a failed collective's, past the
    teardown): what the hooks packed for it must not keep the tensors it saved, views of
    parameters included (leaves are the graph's own business)."""
    import gc
    import weakref

    counter = SavedTensorCounter()
    weight = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    graph: list[torch.Tensor] = []
    refs: list[weakref.ref[torch.Tensor]] = []
    with pytest.raises(RuntimeError, match="collective failed"), counter.track():
        hidden, transposed = x * 2, weight.t()
        refs += [weakref.ref(hidden), weakref.ref(transposed)]
        graph.append(hidden @ transposed)  # saves both: an activation, a parameter's view
        del hidden, transposed
        raise RuntimeError("collective failed")
    gc.collect()
    assert graph[0].grad_fn is not None  # the graph is still held...
    assert [r() for r in refs] == [None, None]  # ...but not what it saved
