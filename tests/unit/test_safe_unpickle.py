"""The allow-list unpickler: DCP metadata and plain values load, anything that would run code is
refused, naming what it would call, before any of it runs."""

from __future__ import annotations

import collections
import enum
import io
import os
import pickle
from pathlib import Path, PosixPath
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from checkpoint.safe_unpickle import UnsafePickle, load_metadata, load_torch_value, load_value

pytestmark = pytest.mark.unit


class _Touches:
    """Unpickling it creates `path` (through open, or os.system with `shell`)."""

    def __init__(self, path: Path, shell: bool = False) -> None:
        self.path, self.shell = path, shell

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.shell:
            return os.system, (f"touch '{self.path}'",)
        return open, (str(self.path), "w")


def _metadata(storage: Any) -> Metadata:
    index = MetadataIndex("state.model.w", (0, 0), 0)
    props = TensorProperties(dtype=torch.bfloat16, layout=torch.strided,
                             memory_format=torch.channels_last)
    return Metadata(
        state_dict_metadata={
            "state.model.w": TensorStorageMetadata(
                props, torch.Size([4, 2]), [ChunkStorageMetadata(torch.Size([0, 0]),
                                                                 torch.Size([4, 2]))]),
            "state.progress.step": BytesStorageMetadata(),
        },
        storage_data={index: storage},
        storage_meta=StorageMeta(checkpoint_id=PosixPath("/ckpt/step_00000001"), save_id="x"),
    )


def test_dcp_metadata_round_trips():
    metadata = _metadata(_StorageInfo("__0_0.distcp", 0, 32))
    loaded = load_metadata(pickle.dumps(metadata))
    assert loaded == metadata
    props = loaded.state_dict_metadata["state.model.w"].properties
    assert (props.dtype, props.layout, props.memory_format) == (
        torch.bfloat16, torch.strided, torch.channels_last)


class _Py311EnumPickler(pickle.Pickler):
    """Pickles Enum members as Python 3.11.0 to 3.11.4 do: getattr(their class, their name)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _dumps_as_py311(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Py311EnumPickler(buffer).dump(obj)
    return buffer.getvalue()


def test_metadata_pickled_by_python_3_11_2_loads():
    metadata = _metadata(_StorageInfo("__0_0.distcp", 0, 32))
    data = _dumps_as_py311(metadata)
    assert b"getattr" in data, "the pickle names builtins.getattr, as Debian 12's Python writes"
    loaded = load_metadata(data)
    assert loaded == metadata
    assert loaded.state_dict_metadata["state.model.w"].properties.memory_format \
        == torch.channels_last


class _GetattrOf:
    """Unpickling it calls getattr(obj, name)."""

    def __init__(self, obj: Any, name: Any) -> None:
        self.obj, self.name = obj, name

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return getattr, (self.obj, self.name)


@pytest.mark.parametrize("obj, name", [
    (TensorProperties, "__init__"),     # an allowed class, but no Enum
    (torch.Size, "__class__"),
    (_MEM_FORMAT_ENCODING, "__class__"),  # an Enum, but no member
    (_MEM_FORMAT_ENCODING, "mro"),
])
def test_getattr_answers_enum_members_only(obj, name):
    with pytest.raises(UnsafePickle, match="getattr"):
        load_metadata(pickle.dumps(_GetattrOf(obj, name)))


VALUES = [3, -0.0, float("inf"), True, None, "lr", b"\x00", (0.9, 0.999), [1, [2]],
          {"a": {1, 2}}, frozenset({1}), 1 + 2j, collections.OrderedDict(a=1), torch.Size([2]),
          torch.float16]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_plain_values_round_trip(value):
    # Our writers pickle with the default protocol; a newer Python may default to the highest.
    for protocol in (pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL):
        assert load_value(pickle.dumps(value, protocol=protocol)) == value


HOSTILE = {
    "open": lambda p: pickle.dumps(_Touches(p)),
    "os.system": lambda p: pickle.dumps(_Touches(p, shell=True)),
    "nested in plain data": lambda p: pickle.dumps({"lr": [0.1, _Touches(p, shell=True)]}),
}


@pytest.mark.parametrize("make", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("load", [load_metadata, load_value])
def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(make, load, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(UnsafePickle, match=r"^refused: it calls (io\.open|posix\.system), which"):
        load(make(marker))
    assert not marker.exists()


@pytest.mark.parametrize("blob, why", [
    (pickle.dumps(torch.zeros(2)), r"it calls torch\._utils\._rebuild_tensor_v2"),
    (pickle.dumps(Path("x")), r"it calls pathlib\.PosixPath"),  # metadata only
    (b"\x80\x04\x95", r"not a pickle of plain data \(UnpicklingError"),
    # A name of torch that is not a dtype: torch.load is a function, and never resolved.
    (b"\x80\x04\x8c\x05torch\x8c\x04load\x93.", r"it calls torch\.load"),
    (b"\x80\x04\x8c\x011Q.", r"persistent object"),
])
def test_values_are_plain_data_only(blob, why):
    with pytest.raises(UnsafePickle, match=why):
        load_value(blob)


def test_metadata_must_be_dcp_metadata():
    with pytest.raises(UnsafePickle, match="holds a dict, not DCP Metadata"):
        load_metadata(pickle.dumps({"state_dict_metadata": {}}))


def test_torch_values_load_weights_only(tmp_path):
    buffer = io.BytesIO()
    torch.save({"betas": (0.9, 0.95), "step": torch.tensor(3.0)}, buffer)
    assert load_torch_value(buffer.getvalue())["betas"] == (0.9, 0.95)
    marker = tmp_path / "ran"
    hostile = io.BytesIO()
    torch.save(_Touches(marker, shell=True), hostile)
    with pytest.raises(UnsafePickle, match=r"^refused: it calls posix\.system, which"):
        load_torch_value(hostile.getvalue())
    assert not marker.exists()
