"""Write Hugging Face safetensors files one tensor at a time, in bounded memory.

The safetensors layout is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the tensors' bytes back to back. Shapes and dtypes
are known before any value is read (from the checkpoint's metadata), so the header is written
first and each tensor is appended as soon as it is loaded and dropped after: memory holds one
tensor at a time. Above `max_shard_bytes` the model is split into
`model-0000k-of-0000n.safetensors` files with a `model.safetensors.index.json`, as
`save_pretrained` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# transformers' default max_shard_size ("5GB", decimal).
MAX_SHARD_BYTES = 5 * 10**9
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class Planned:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def _shards(tensors: Sequence[Planned], max_bytes: int) -> list[list[Planned]]:
    shards: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(tensors: Sequence[Planned]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        entries[t.name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)  # the data starts 8-byte aligned


def write_safetensors(out_dir: Path, tensors: Sequence[Planned],
                      load: Callable[[Planned], torch.Tensor],
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write `tensors` (in order) with values from `load`, each called once per tensor."""
    shards = _shards(tensors, max_shard_bytes)
    n = len(shards)
    names = (["model.safetensors"] if n == 1
             else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    written = []
    for name, shard in zip(names, shards, strict=True):
        path = out_dir / name
        header = _header(shard)
        with open(path, "wb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            for t in shard:
                value = load(t).to(t.dtype).contiguous().cpu()
                if tuple(value.shape) != t.shape:
                    raise ValueError(f"{t.name}: loaded shape {list(value.shape)}, "
                                     f"planned {list(t.shape)}")
                f.write(value.view(torch.uint8).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        written.append(path)
    if n > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards, strict=True)
                                for t in shard}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return written
