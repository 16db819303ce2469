"""Rewriting a snapshot without asking DCP for the state dict again (docs/snapshots.md).

A rewrite (`snapshot_writer.rewrite_snapshot`) writes the same items at the same offsets every
step. Most of its cost was not the copy but finding the items again: `get_state_dict` over the
model and the optimizer, then DCP's planner flattening the result and narrowing every tensor to
its chunk: most of a rewrite's time (docs/architecture.md, "Costs behind the code").

Those lookups give the same answer every step as long as the training updates its tensors in
place, which parameters and optimizer moments are. So after a rewrite has resolved the items
once, `ResolvedTemplate` keeps:
- each tensor item as the view DCP resolved, which aliases the live parameter's or optimizer
  state's memory and so reads this step's values;
- each byte item (progress, the optimizer's hyper-parameters) as a getter of its current value,
  found through the identity of the parameter it belongs to and checked, when built, to give
  exactly the value DCP's state dict gave;
- the RNG state, fetched fresh (it is a new tensor every time).

Before every use it checks, in a few dictionary lookups per tensor and no walk of the model,
that every live tensor the views alias is still where the build found it, reached the same way
from the state (each module on its path, the optimizer's state dict and the tensor's own entry)
and still starting at the same address. Any change (a module, parameter or optimizer state
replaced rather than updated, a parameter given new memory) sends that rewrite down the full
path, which builds a new one. Anything it cannot account for (a tensor item that aliases no
live tensor, a byte item without a getter) means no fast path at all.

What the step captures of the byte items is each distinct value once (the step counter, the
consumed samples, each parameter group's hyper-parameters); spreading them over the items (one
per parameter, its group's hyper-parameters: checkpoint/state.py) happens off the step.
"""

from __future__ import annotations

import itertools
import math
import operator
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from checkpoint.state import SAVED_HYPERPARAMETERS, TrainState

_MODEL = "state.model."  # dcp.save({"state": TrainState}) prefixes every key with "state."
_RNG = "state.rng"
_PROGRESS = {"state.progress.step": lambda s: s.progress.step,
             "state.progress.consumed_samples": lambda s: s.progress.consumed_samples}
_MISSING = object()


_local_tensor = operator.attrgetter("_local_tensor")
_data_ptr = torch.Tensor.data_ptr


def _local(t: torch.Tensor) -> torch.Tensor:
    # The local tensor itself, not `to_local()`: that is an autograd function, and this runs
    # for every watched tensor at every snapshot.
    return t._local_tensor if isinstance(t, DTensor) else t  # noqa: SLF001


def _storage(t: torch.Tensor) -> int:
    return int(_local(t).untyped_storage().data_ptr())


def tensor_as_bytes(data: torch.Tensor) -> torch.Tensor:
    """`data`'s elements as flat uint8, on its own device: a view of its memory when it is
    contiguous, else a contiguous copy."""
    dense = data.detach()
    if not dense.is_contiguous():
        dense = dense.contiguous()
    return dense.reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class Link:
    """One step of the way from the state to a live tensor: `owner[key] is value` (a dict
    entry, or a list position for parameter groups)."""

    owner: dict[Any, Any] | list[Any]
    key: Any
    value: Any


@dataclass(frozen=True)
class Links:
    """Links to check together, in a few C-level passes with no Python frame per link."""

    owners: tuple[dict[Any, Any], ...]
    keys: tuple[Any, ...]
    values: tuple[Any, ...]
    # Dicts keyed by tensors (the optimizer's state, by parameter), whose lookups would each
    # hash a tensor in Python: each is held whole, its keys and values in order, as built.
    whole: tuple[tuple[dict[Any, Any], tuple[Any, ...], tuple[Any, ...]], ...]
    positions: tuple[Link, ...]  # list owners (parameter groups), checked one by one

    @staticmethod
    def of(links: list[Link]) -> Links:
        by_tensor = {id(link.owner): link.owner for link in links
                     if isinstance(link.owner, dict) and isinstance(link.key, torch.Tensor)}
        entries = [link for link in links
                   if isinstance(link.owner, dict) and id(link.owner) not in by_tensor]
        return Links(tuple(link.owner for link in entries),  # type: ignore[misc]
                     tuple(link.key for link in entries), tuple(link.value for link in entries),
                     tuple((owner, tuple(owner), tuple(owner.values()))
                           for owner in by_tensor.values()),
                     tuple(link for link in links if isinstance(link.owner, list)))

    def holds(self) -> bool:
        # `dict.get`, not `owner[key]`: a defaultdict stays as it is (no entry made).
        return (all(map(operator.is_, map(dict.get, self.owners, self.keys,
                                          itertools.repeat(_MISSING)), self.values))
                and all(len(owner) == len(keys) and all(map(operator.is_, owner, keys))
                        and all(map(operator.is_, owner.values(), values))
                        for owner, keys, values in self.whole)
                and all(link.key < len(link.owner) and link.owner[link.key] is link.value
                        for link in self.positions))


def _live(state: TrainState) -> dict[int, tuple[tuple[Link, ...], torch.Tensor]]:
    """Every parameter, buffer and optimizer state tensor by its storage: the links that reach
    it from `state`, and the tensor. The first way found wins (a tied weight has several)."""
    found: dict[int, tuple[tuple[Link, ...], torch.Tensor]] = {}

    def add(tensor: torch.Tensor, links: tuple[Link, ...]) -> None:
        ptr = _storage(tensor)
        if ptr not in found:
            found[ptr] = (links, tensor)

    def walk(module: torch.nn.Module, links: tuple[Link, ...]) -> None:
        for table in (module._parameters, module._buffers):  # noqa: SLF001
            for name, tensor in table.items():
                if tensor is not None:
                    add(tensor, (*links, Link(table, name, tensor)))
        for name, child in module._modules.items():  # noqa: SLF001
            if child is not None:
                walk(child, (*links, Link(module._modules, name, child)))  # noqa: SLF001

    walk(state.model, (Link(vars(state), "model", state.model),))
    optimizer = state.optimizer
    root = (Link(vars(state), "optimizer", optimizer),
            Link(vars(optimizer), "state", optimizer.state))
    for parameter, per_param in optimizer.state.items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                add(value, (*root, Link(optimizer.state, parameter, per_param),
                            Link(per_param, key, value)))
    return found


@dataclass(frozen=True)
class ByteValues:
    """The byte items' values as a step captured them: `values[j]` is the value of each
    template item in `holders[j]`."""

    values: tuple[Any, ...]
    holders: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(by_index: dict[int, Any]) -> ByteValues:
        """One value per item (the full lookup's)."""
        return ByteValues(tuple(by_index.values()), tuple((index,) for index in by_index))


@dataclass(frozen=True)
class ResolvedTemplate:
    """A rewrite's payload sources (see the module docstring), for a template whose items have
    fixed lengths."""

    links: Links  # every step of every watched tensor's way, each once
    # Each watched DTensor, and where its local tensor started when built; the same for each
    # other watched tensor.
    sharded: tuple[DTensor, ...]
    sharded_at: tuple[int, ...]
    plain: tuple[torch.Tensor, ...]
    plain_at: tuple[int, ...]
    reads: tuple[Callable[[], Any], ...]  # each distinct byte value's getter
    holders: tuple[tuple[int, ...], ...]  # holders[j]: the template items read j gives
    # Each non-empty tensor item, in template order: a flat uint8 view of the live tensor's own
    # memory (contiguous tensors), which reads its values at every use, or else None and the
    # source to convert at every use (the RNG state's getter, a non-contiguous tensor).
    tensors: tuple[tuple[torch.Tensor | None, Callable[[], torch.Tensor] | torch.Tensor], ...]

    def usable(self) -> bool:
        """Whether every watched tensor is still where the build found it (module docstring)."""
        return (self.links.holds()
                and tuple(map(_data_ptr, map(_local_tensor, self.sharded))) == self.sharded_at
                and tuple(map(_data_ptr, self.plain)) == self.plain_at)

    def values(self) -> ByteValues:
        return ByteValues(tuple(read() for read in self.reads), self.holders)

    def tensor_bytes(self) -> list[torch.Tensor]:
        return [view if view is not None
                else tensor_as_bytes(source() if callable(source) else source)
                for view, source in self.tensors]


def build(state: TrainState, flat: dict[str, Any], items: list[tuple[Any, Any, bool, int]]
          ) -> ResolvedTemplate | None:
    """From a full rewrite's resolution: `flat` is the planner's flattened state dict and
    `items` each (WriteItem, its tensor or a byte item's value, is a byte item, its length in
    the shard). None: no fast path."""
    live = _live(state)
    groups = _groups_by_parameter_storage(state)
    links: dict[tuple[int, Any], Link] = {}
    watched: dict[int, torch.Tensor] = {}  # by storage: each live tensor the views alias
    reads: dict[Any, int] = {}  # a distinct byte value's key -> its index in `getters`
    getters: list[Callable[[], Any]] = []
    holders: list[list[int]] = []
    tensors: list[tuple[torch.Tensor | None, Callable[[], torch.Tensor] | torch.Tensor]] = []
    for index, (item, data, byte_item, length) in enumerate(items):
        fqn = item.index.fqn
        if byte_item:
            found = _byte_getter(state, flat, groups, fqn)
            if found is None or pickle.dumps(found[1]()) != pickle.dumps(data):
                return None
            key, getter, way = found
            if key not in reads:
                reads[key] = len(getters)
                getters.append(getter)
                holders.append([])
                links.update(((id(link.owner), link.key), link) for link in way)
            holders[reads[key]].append(index)
        elif fqn == _RNG:
            if length:
                tensors.append((None, torch.get_rng_state))
        else:
            ptr = _storage(data)
            if ptr not in live:
                return None  # a copy DCP made: its values would never change again
            way, tensor = live[ptr]
            if not length:
                continue
            links.update(((id(link.owner), link.key), link) for link in way)
            watched[ptr] = tensor
            tensors.append((_memory_of(data), data))
    if not all(isinstance(link.owner, dict | list) for link in links.values()):
        return None
    sharded = tuple(t for t in watched.values() if isinstance(t, DTensor))
    plain = tuple(t for t in watched.values() if not isinstance(t, DTensor))
    return ResolvedTemplate(
        links=Links.of(list(links.values())),
        sharded=sharded, sharded_at=tuple(_local(t).data_ptr() for t in sharded),
        plain=plain, plain_at=tuple(t.data_ptr() for t in plain),
        reads=tuple(getters), holders=tuple(map(tuple, holders)), tensors=tuple(tensors))


def _memory_of(data: torch.Tensor) -> torch.Tensor | None:
    """`data`'s bytes as a view of its own memory, which reads its values at every use: only
    for a contiguous tensor (anything else needs a copy, which would not follow updates)."""
    if not data.is_contiguous() or data.numel() == 0:
        return None
    return data.detach().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are the same immutable value, down to its pickle: -0.0 is not 0.0,
    1 is not 1.0 or True, NaN is never the same, and a mutable value (which may have changed
    in place) is never the same either."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return isinstance(a, int | str | bytes | type(None)) and a == b


def _groups_by_parameter_storage(state: TrainState) -> dict[int, int]:
    """Each parameter's storage -> the index of its group in the optimizer's param_groups."""
    return {_storage(p): i for i, group in enumerate(state.optimizer.param_groups)
            for p in group["params"]}


def _byte_getter(state: TrainState, flat: dict[str, Any], groups: dict[int, int], fqn: str
                 ) -> tuple[Any, Callable[[], Any], tuple[Link, ...]] | None:
    """Byte item `fqn`'s (key of its distinct value, getter, links the getter relies on)."""
    if fqn in _PROGRESS:
        read = _PROGRESS[fqn]
        return fqn, lambda: read(state), ()
    if not fqn.startswith(SAVED_HYPERPARAMETERS):
        return None
    # "state.optim.hyperparameters.<parameter fqn>": its group's (name, value) pairs by name
    # (checkpoint/state.py), read afresh from the group.
    parameter = fqn[len(SAVED_HYPERPARAMETERS):]
    tensor, pairs = flat.get(_MODEL + parameter), flat.get(fqn)
    if not isinstance(tensor, torch.Tensor) or not isinstance(pairs, tuple):
        return None
    index = groups.get(_storage(tensor))
    if index is None:
        return None
    optimizer = state.optimizer
    group = optimizer.param_groups[index]
    names = tuple(pair[0] for pair in pairs)
    if not all(name in group for name in names):
        return None
    way = (Link(vars(state), "optimizer", optimizer),
           Link(vars(optimizer), "param_groups", optimizer.param_groups),
           Link(optimizer.param_groups, index, group))
    return ("group", index, names), lambda: tuple((name, group[name]) for name in names), way
