"""Reading the pickles a checkpoint or snapshot holds without running them (docs/checkpoints.md,
"Loading safely").

A pickle is a small program: it names functions and classes (pickle's "globals") and calls
them, so unpickling a file someone else wrote runs whatever it names (`os.system`, `open`).
Checksums and manifests prove a file is the one that was written, not that its writer was
honest: a peer that forges a snapshot, or anyone who can write a checkpoint directory, sets
the checksums too. So nothing read back from a checkpoint, a snapshot or a peer is unpickled
with pickle's default lookup:

- a durable checkpoint's `.metadata` (DCP's) goes through `load_metadata`: an unpickler whose
  `find_class` resolves only the classes DCP's `Metadata` is built from, torch.Size, dtypes,
  layouts and paths (the "Restricting Globals" recipe of Python's pickle documentation); a
  snapshot's `.metadata` is no pickle (checkpoint/snapshot_index.py);
- a snapshot's byte items (progress, optimizer hyper-parameters: plain values, pickled by
  checkpoint/snapshot_writer.py) go through `load_value`, which resolves even less: builtin
  scalars and containers, torch.Size and dtypes;
- a durable checkpoint's byte items, which DCP writes with torch.save, go through
  `load_torch_value`: `torch.load(weights_only=True)`, torch's own restricted unpickler.

Anything else a pickle names is refused with `UnsafePickle`, which says what it named; the
callers turn that into the same "invalid, fall back" as a checksum mismatch, naming the file.
"""

from __future__ import annotations

import collections
import enum
import io
import pathlib
import pickle
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import ReadItem

from checkpoint.state import present_as_saved


class UnsafePickle(ValueError):
    """A pickle that names something outside its allow-list, or is not a pickle at all."""


def _globals(*objects: Any) -> dict[tuple[str, str], Any]:
    return {(obj.__module__, obj.__qualname__): obj for obj in objects}


# Plain values: what a snapshot's byte item may hold. Protocol 2+ pickles build ints, floats,
# strings, bytes, tuples, lists, dicts and sets with opcodes of their own; these are the few
# plain values that are pickled as calls.
_VALUE_GLOBALS: Mapping[tuple[str, str], Any] = MappingProxyType({
    ("builtins", "complex"): complex,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
    # Each dtype is pickled by name as an attribute of torch (torch.float32): only those names.
    **{("torch", str(d).removeprefix("torch.")): d
       for d in vars(torch).values() if isinstance(d, torch.dtype)},
})

def _enum_member(cls: Any, name: Any) -> Any:
    """`getattr` as Python 3.11.0 to 3.11.4 (Debian 12's 3.11.2 among them) pickle an Enum
    member: getattr(its class, its name). The class was resolved through the allow-list; only
    a member of an Enum class is answered, never another attribute."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str)
            and name in cls.__members__):
        raise UnsafePickle(f"it calls builtins.getattr on {getattr(cls, '__qualname__', cls)!r}"
                           f".{name!r}, which is no Enum member")
    return cls.__members__[name]


# DCP's Metadata: the dataclasses it is made of, the storage records of DCP's file system
# writer, and what their fields hold.
_METADATA_GLOBALS: Mapping[tuple[str, str], Any] = MappingProxyType({
    **_VALUE_GLOBALS,
    **_globals(
        dcp_metadata.Metadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata._MEM_FORMAT_ENCODING,  # noqa: SLF001 - how TensorProperties pickles a memory format
        dcp_filesystem._StorageInfo,  # noqa: SLF001 - the durable writer's record of one item
        pathlib.PosixPath,  # StorageMeta.checkpoint_id: the directory DCP wrote to
        pathlib.PurePosixPath,
    ),
    # A layout is pickled as a call of this lookup by name (torch/serialization.py).
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # noqa: SLF001
    # _MEM_FORMAT_ENCODING's members, as some Python 3.11 releases pickle them.
    ("builtins", "getattr"): _enum_member,
})


class _Restricted(pickle.Unpickler):
    """An unpickler that resolves only the globals in `allowed` (a class attribute, so that
    making one per byte item costs no Python-level __init__: a restore makes hundreds)."""

    allowed: Mapping[tuple[str, str], Any] = MappingProxyType({})

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise UnsafePickle(f"it calls {module}.{name}, which no checkpoint needs")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("it refers to a persistent object, which no checkpoint needs")


class _MetadataUnpickler(_Restricted):
    allowed = _METADATA_GLOBALS


class _ValueUnpickler(_Restricted):
    allowed = _VALUE_GLOBALS


def _load(data: bytes, unpickler: type[_Restricted]) -> Any:
    try:
        return unpickler(io.BytesIO(data)).load()
    except UnsafePickle as exc:
        raise UnsafePickle(f"refused: {exc}") from None
    # Whatever else a malformed pickle raises from the allowed constructors: the file is bad.
    except Exception as exc:  # noqa: BLE001
        raise UnsafePickle(f"refused: not a pickle of plain data ({type(exc).__name__}: "
                           f"{str(exc)[:200]})") from None


def load_metadata(data: bytes) -> Metadata:
    """DCP `Metadata` from the bytes of a `.metadata` file, resolving only its own classes."""
    metadata = _load(data, _MetadataUnpickler)
    if not isinstance(metadata, Metadata):
        raise UnsafePickle(f"refused: it holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def load_value(data: bytes) -> Any:
    """A snapshot byte item's value: plain data only."""
    return _load(data, _ValueUnpickler)


_TORCH_GLOBAL = re.compile(r"GLOBAL (\S+?)[\s,]")


def load_torch_value(data: bytes) -> Any:
    """A durable checkpoint's byte item (DCP writes it with torch.save), through torch's own
    restricted unpickler."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds for a bad file
        named = _TORCH_GLOBAL.search(str(exc))
        why = (f"it calls {named.group(1)}, which no checkpoint needs" if named
               else f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        raise UnsafePickle(f"refused: {why}") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that byte items are never unpickled by it.

    Readers of ours hand it each byte item's value, already loaded safely (`load_value`);
    DefaultLoadPlanner's own `load_bytes` would call torch.load with weights_only=False. A
    TrainState is presented in the form the checkpoint was saved in (`present_as_saved`)."""

    def set_up_planner(self, state_dict: STATE_DICT_TYPE, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        if metadata is not None:
            present_as_saved(state_dict, metadata.state_dict_metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
        else:
            self.state_dict[read_item.dest_index.fqn] = value

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.load_value(read_item, load_torch_value(value.getvalue()))
