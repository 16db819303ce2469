"""Rewriting a snapshot without asking DCP for the state dict again (docs/snapshots.md).

A rewrite (`snapshot_writer.rewrite_snapshot`) writes the same items at the same offsets every
step. Most of its cost was not the copy but finding the items again: `get_state_dict` over the
model and the optimizer, then DCP's planner flattening the result and narrowing every tensor to
its chunk, about two thirds of 13 ms per rank per step on the small job.

Those lookups give the same answer every step as long as the training updates its tensors in
place, which parameters and optimizer moments are. So after a rewrite has resolved the items
once, `ResolvedTemplate` keeps:
- each tensor item as the view DCP resolved, which aliases the live parameter's or optimizer
  state's memory and so reads this step's values;
- each byte item (progress, the optimizer's hyper-parameters) as a getter of its current value,
  found through the identity of the parameter it belongs to and checked, when built, to give
  exactly the value DCP's state dict gave;
- the RNG state, fetched fresh (it is a new tensor every time).

Before every use it checks that every view still aliases a live tensor of the model or the
optimizer; any change (a tensor replaced rather than updated, a new optimizer state) sends that
rewrite down the full path, which builds a new one. Anything it cannot account for (a tensor
item that aliases no live tensor, a byte item without a getter) means no fast path at all.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from checkpoint.snapshot_format import slot
from checkpoint.state import TrainState

_MODEL = "state.model."  # dcp.save({"state": TrainState}) prefixes every key with "state."
_PARAM_GROUPS = "state.optim.param_groups."
_RNG = "state.rng"
_PROGRESS = {"state.progress.step": lambda s: s.progress.step,
             "state.progress.consumed_samples": lambda s: s.progress.consumed_samples}


def _storage(t: torch.Tensor) -> int:
    # The local tensor itself, not `to_local()`: that is an autograd function, and this runs
    # for every state tensor at every snapshot (it was most of a rewrite's lookup cost).
    local = t._local_tensor if isinstance(t, DTensor) else t  # noqa: SLF001
    return int(local.untyped_storage().data_ptr())


def tensor_as_bytes(data: torch.Tensor) -> torch.Tensor:
    """`data`'s elements as flat uint8, on its own device: a view of its memory when it is
    contiguous, else a contiguous copy."""
    dense = data.detach()
    if not dense.is_contiguous():
        dense = dense.contiguous()
    return dense.reshape(-1).view(torch.uint8)


def live_storages(state: TrainState) -> frozenset[int]:
    """The memory of every parameter, buffer and optimizer state tensor, as it is now.

    Read from each module's own parameter and buffer dicts (what `parameters()` and
    `buffers()` walk, without their generators: this runs at every snapshot)."""
    tensors = [t for module in state.model.modules()
               for t in (*module._parameters.values(), *module._buffers.values())  # noqa: SLF001
               if t is not None]
    for per_param in state.optimizer.state.values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return frozenset(_storage(t) for t in tensors)


@dataclass(frozen=True)
class Capture:
    """What a rewrite reads from the state on the step, in the order it needs it: each byte
    item's template index and value getter, and each non-empty tensor item's bytes (a view of
    the live tensor's memory, or for the RNG state and non-contiguous tensors, a source to
    convert at every use)."""

    getters: tuple[tuple[int, Callable[[], Any]], ...]
    tensors: tuple[tuple[torch.Tensor | None, Callable[[], torch.Tensor] | torch.Tensor], ...]

    def values(self) -> dict[int, Any]:
        return {index: get() for index, get in self.getters}

    def tensor_bytes(self) -> list[torch.Tensor]:
        return [view if view is not None
                else tensor_as_bytes(source() if callable(source) else source)
                for view, source in self.tensors]


@dataclass(frozen=True)
class ResolvedTemplate:
    """A rewrite's payload sources (see the module docstring), in template order."""

    sources: tuple[Callable[[], torch.Tensor | Any] | torch.Tensor, ...]
    is_bytes: tuple[bool, ...]
    storages: frozenset[int]  # what the views alias
    # Each tensor item's bytes as a flat uint8 view of the live tensor's own memory (contiguous
    # tensors), which reads its values at every use: copied as they are, with no per-item
    # conversion. None: converted each time (a byte item, the RNG state, a non-contiguous one).
    views: tuple[torch.Tensor | None, ...] = ()
    # Byte item index -> (its value, its slot) as last written: a value that did not change
    # (hyper-parameters, mostly) is not pickled again.
    slots: dict[int, tuple[Any, bytes]] = field(default_factory=dict, compare=False, repr=False)
    # The capture of the template's items with these lengths (`capture`), made on first use.
    _captures: dict[tuple[int, ...], Capture] = field(
        default_factory=dict, compare=False, repr=False)

    def slotted(self, index: int, value: Any, length: int) -> bytes:
        """Byte item `index`'s slot of `length` bytes holding `value` (ValueError: too big)."""
        last = self.slots.get(index)
        if last is not None and _same(last[0], value):
            return last[1]
        raw = slot(pickle.dumps(value), length)
        self.slots[index] = (value, raw)
        return raw

    def usable(self, state: TrainState) -> bool:
        return self.storages <= live_storages(state)

    def capture(self, lengths: tuple[int, ...]) -> Capture:
        """What a rewrite of the template whose items have `lengths` reads (empty tensor
        items have nothing to copy), worked out once."""
        found = self._captures.get(lengths)
        if found is None:
            items = list(zip(self.sources, self.is_bytes, self.views, lengths, strict=True))
            found = Capture(
                getters=tuple((index, source) for index, (source, is_bytes, _, _)
                              in enumerate(items) if is_bytes),
                tensors=tuple((view, source) for source, is_bytes, view, length in items
                              if not is_bytes and length))
            self._captures[lengths] = found
        return found


def build(state: TrainState, flat: dict[str, Any], items: list[tuple[Any, Any, bool]]
          ) -> ResolvedTemplate | None:
    """From a full rewrite's resolution: `flat` is the planner's flattened state dict and
    `items` each (WriteItem, its tensor or a byte item's value, is a byte item). None: no fast
    path."""
    live = live_storages(state)
    groups = _groups_by_parameter_storage(state)
    sources: list[Callable[[], Any] | torch.Tensor] = []
    is_bytes: list[bool] = []
    views: list[memoryview | None] = []
    aliased: set[int] = set()
    for item, data, byte_item in items:
        fqn = item.index.fqn
        if byte_item:
            getter = _byte_getter(state, flat, groups, fqn)
            if getter is None or pickle.dumps(getter()) != pickle.dumps(data):
                return None
            sources.append(getter)
            is_bytes.append(True)
            views.append(None)
        elif fqn == _RNG:
            sources.append(torch.get_rng_state)
            is_bytes.append(False)
            views.append(None)
        else:
            ptr = _storage(data)
            if ptr not in live:
                return None  # a copy DCP made: its values would never change again
            aliased.add(ptr)
            sources.append(data)
            is_bytes.append(False)
            views.append(_memory_of(data))
    return ResolvedTemplate(tuple(sources), tuple(is_bytes), frozenset(aliased), tuple(views))


def _memory_of(data: torch.Tensor) -> torch.Tensor | None:
    """`data`'s bytes as a view of its own memory, which reads its values at every use: only
    for a contiguous tensor (anything else needs a copy, which would not follow updates)."""
    if not data.is_contiguous() or data.numel() == 0:
        return None
    return data.detach().reshape(-1).view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are the same immutable value, down to its pickle: -0.0 is not 0.0,
    1 is not 1.0 or True, NaN is never the same, and a mutable value (which may have changed
    in place) is never the same either."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return isinstance(a, int | str | bytes | type(None)) and a == b


def _groups_by_parameter_storage(state: TrainState) -> dict[int, dict[str, Any]]:
    return {_storage(p): group for group in state.optimizer.param_groups
            for p in group["params"]}


def _byte_getter(state: TrainState, flat: dict[str, Any], groups: dict[int, dict[str, Any]],
                 fqn: str) -> Callable[[], Any] | None:
    if fqn in _PROGRESS:
        read = _PROGRESS[fqn]
        return lambda: read(state)
    if not fqn.startswith(_PARAM_GROUPS):
        return None
    # "state.optim.param_groups.<parameter fqn>.<hyper-parameter>"; no hyper-parameter name
    # has a dot, so the last component is it and the rest names the parameter.
    parameter, _, key = fqn[len(_PARAM_GROUPS):].rpartition(".")
    tensor = flat.get(_MODEL + parameter)
    if not isinstance(tensor, torch.Tensor):
        return None
    group = groups.get(_storage(tensor))
    if group is None or key not in group:
        return None
    return lambda: group[key]
