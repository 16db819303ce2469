"""Load a Hugging Face model's weights (`[init] hf`) straight into this rank's layout.

DCP's `HuggingFaceStorageReader` presents the directory's safetensors files (one or sharded) as a
checkpoint; the model's state dict holds this rank's shards (DTensors under TP/FSDP2, only its
own layers under PP) under our names, which the family's adapter maps to Hugging Face's. DCP
then reads, from each file, only the slice each rank holds (safetensors slices), into that
rank's tensors: no rank ever holds the whole model. Values are cast on copy (bf16 files into
fp32 parameters exactly). A tensor we stack (a MoE layer's experts, one file tensor each) is
read through views of the rows this rank holds: under expert parallelism each rank reads only
its own experts.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from models import spec_of
from models.spec import HFTensor


class PretrainedInvalid(ValueError):
    """The directory does not hold the weights the job's model needs; says which."""


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of a tensor stacked along dim 0 and the global index of its first row.

    Expert parallelism (and ZeRO over the expert-data-parallel ranks) splits only dim 0, so a
    rank holds a run of whole experts; the offset is the one DCP itself saves the shard at."""
    if not isinstance(tensor, DTensor):
        return tensor.detach(), 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape[1:]) != tuple(tensor.shape[1:]) or any(offset[1:]):
        raise PretrainedInvalid(f"init.hf: a stacked tensor split below dim 0 ({shape} at "
                                f"{offset}) cannot be read one expert at a time")
    return tensor.to_local().detach(), offset[0]


def _file_tensors(ours: dict[str, torch.Tensor], table: dict[str, list[HFTensor]],
                  ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """The file tensors to read into this rank's state dict `ours`, each a view of its memory
    (a stacked tensor: only the rows this rank holds), and every file tensor the state dict
    needs, with its shape, whichever rank holds it."""
    reads: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in ours.items():
        parts = table.get(name)
        if parts is None:
            raise PretrainedInvalid(f"init.hf: the model's {name} has no Hugging Face tensor")
        if parts[0].index is None:
            reads[parts[0].hf] = tensor
            shapes[parts[0].hf] = tuple(tensor.shape)  # a DTensor's shape is the whole tensor's
            continue
        if [p.index for p in parts] != list(range(tensor.shape[0])):
            raise PretrainedInvalid(f"init.hf: {name} has {tensor.shape[0]} rows, the files "
                                    f"{len(parts)} slices")
        shapes |= {p.hf: tuple(tensor.shape[1:]) for p in parts}
        rows, first = _local_rows(tensor)
        reads |= {parts[first + j].hf: rows[j] for j in range(rows.shape[0])}
    return reads, shapes


def load_pretrained(model: nn.Module, directory: Path,
                    group: dist.ProcessGroup | None = None) -> None:
    """Overwrite `model`'s parameters (all ranks together) with those of `directory`."""
    spec = spec_of(model)
    if not any(directory.glob("*.safetensors")):
        raise PretrainedInvalid(f"init.hf: {directory} holds no *.safetensors file")
    ours = get_model_state_dict(model)
    if model.cfg.tie_word_embeddings:
        # One tensor under two names: Hugging Face files hold it once, as the embedding.
        ours.pop("lm_head.weight", None)
    # Buffers are our own state (a routing bias, zero at start), not in Hugging Face's files.
    for name, _ in model.named_buffers():
        ours.pop(name, None)
    theirs, shapes = _file_tensors(ours, spec.hf.by_ours(model.cfg))
    reader = HuggingFaceStorageReader(str(directory))
    stored = reader.read_metadata().state_dict_metadata
    missing = sorted(set(shapes) - set(stored))
    if missing:
        raise PretrainedInvalid(
            f"init.hf: {directory} lacks {len(missing)} tensor(s) the model needs, e.g. "
            f"{', '.join(missing[:3])}"
        )
    for name, shape in shapes.items():
        size = tuple(stored[name].size)  # type: ignore[union-attr]
        if size != shape:
            raise PretrainedInvalid(f"init.hf: {directory}: {name} has shape {list(size)}, "
                                    f"the model's is {list(shape)}")
    dcp.load(theirs, storage_reader=reader, process_group=group)
    # DCP filled the state dict's tensors (a stacked one through views of its rows); where
    # they are not the parameters' own memory (a copy some wrapper made), hand them over.
    set_model_state_dict(model, ours, options=StateDictOptions(strict=False))
