"""Measured memory of one rank, by kind: what `parallel/memory_model.py` predicts, counted.

- params: the parameter storage the rank holds at rest (its TP/ZeRO shards), after the step.
- grads: the peak of the gradients it holds in the step: ZeRO-1's full gradients as autograd
  accumulates them (before the reduce-scatter drops them), FSDP2's sharded gradients as the
  optimizer step begins.
- optimizer: every tensor of the optimizer state (moments and step counters), after the step.
- activations: the peak bytes of tensors autograd saves for backward, tracked with saved-tensor
  hooks from the forward until backward frees them. A checkpointed block's own saved tensors are
  held by `torch.utils.checkpoint` behind its own hooks, so under recomputation only what is
  saved outside the blocks is seen.

Tensors are counted by storage, each storage once: a view (or a tensor saved by two ops) costs
what its storage costs, and FSDP2's padded shards count with their padding. Parameters saved by
an op (a weight kept for its input gradient) are not activations and are skipped.

With saved-tensor hooks, autograd keeps what the hook packed (a Python object) instead of the bare
tensor. A step that fails in a collective can leave part of its autograd graph alive past the
teardown, and what was packed then keeps the old world's DeviceMesh and process groups alive
with it (gloo closes a group's connections only when it is freed, so peers blocked on this rank
wait for their timeout). Everything packed is wrapped, parameters too, and a step that raises
empties every wrapper it made before the error leaves `track()`.

On CUDA the allocator's peak (`torch.cuda.max_memory_allocated`) over the step is reported too:
it includes what the kinds leave out (ZeRO-2/3's gathered parameters, communication buffers).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


@dataclass(frozen=True)
class MeasuredMemory:
    """Bytes one rank held in a step, by kind; `peak` is the CUDA allocator's (None on CPU)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int | None = None


def _storage(t: torch.Tensor) -> tuple[tuple[str, int], int]:
    """(a key naming `t`'s storage, the storage's bytes).

    A wrapper subclass (a DTensor, or the AsyncCollectiveTensor a TP collective returns) has no
    storage of its own: it is counted by the tensor it wraps.
    """
    while is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        t = getattr(t, inner[0])
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr()), s.nbytes()


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (None entries are skipped)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is not None:
            key, nbytes = _storage(t)
            seen[key] = nbytes
    return sum(seen.values())


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (the transposed weight a matmul saves)."""
    return isinstance(t._base if t._base is not None else t, torch.nn.Parameter)


class SavedTensorCounter:
    """Live and peak bytes of the tensors autograd saves, within `track()`, storage-deduplicated."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[tuple[str, int], list[int]] = {}  # key -> [saved tensors, bytes]
        self._packed: weakref.WeakSet[_Saved] = weakref.WeakSet()  # this step's, still held

    def reset(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.live

    def _pack(self, t: torch.Tensor) -> Any:
        if _is_parameter(t):
            saved = _Saved(t, None, self)  # not an activation: not counted
        else:
            key, nbytes = _storage(t)
            ref = self._refs.setdefault(key, [0, nbytes])
            if ref[0] == 0:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            ref[0] += 1
            saved = _Saved(t, key, self)
        self._packed.add(saved)
        return saved

    def _release(self, key: tuple[str, int]) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._refs[key]

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self._packed = weakref.WeakSet()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        except BaseException:
            # Whatever autograd still holds of this step must not hold its tensors (see the
            # module docstring); the step is abandoned, nothing will unpack them.
            for saved in list(self._packed):
                saved.tensor = None
            raise


class _Saved:
    """A saved tensor as autograd holds it; dropping it (backward is done with it) releases it."""

    __slots__ = ("__weakref__", "counter", "key", "tensor")

    def __init__(self, tensor: torch.Tensor, key: tuple[str, int] | None,
                 counter: SavedTensorCounter):
        self.tensor: torch.Tensor | None = tensor
        self.key, self.counter = key, counter  # key None: a parameter, not counted

    def __del__(self) -> None:
        if self.key is not None:
            self.counter._release(self.key)


class MemoryMeter:
    """Measures a trainer's memory by kind, one step at a time: wrap each step in `measure()`.

    Hooks go on the parameters (gradient accumulation) and the optimizer (before and after its
    step); the meter keeps no reference to either, so dropping the trainer frees them.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        self.device = device
        self.saved = SavedTensorCounter()
        self.last: MeasuredMemory | None = None
        self._grads: dict[int, tuple[tuple[str, int], int]] = {}  # id(param) -> its grad
        self._grad_peak = 0
        self._state = (0, 0)  # (params, optimizer) after the last optimizer step
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad)
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)

    def _grad_total(self) -> int:
        return sum(dict(self._grads.values()).values())

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._grads[id(p)] = _storage(p.grad)
            self._grad_peak = max(self._grad_peak, self._grad_total())

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        grads = storage_bytes(p.grad for p in _params(optimizer))
        self._grad_peak = max(self._grad_peak, grads)

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        params = storage_bytes(_params(optimizer))
        state = storage_bytes(
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
        self._state = (params, state)

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Around one training step (forward, backward, optimizer step); sets `last`."""
        self._grads.clear()
        self._grad_peak = 0
        self.saved.reset()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.saved.track():
            yield
        self.last = MeasuredMemory(
            params=self._state[0],
            grads=self._grad_peak,
            optimizer=self._state[1],
            activations=self.saved.peak,
            peak=torch.cuda.max_memory_allocated(self.device) if cuda else None,
        )


def _params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]
