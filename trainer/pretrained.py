"""Load a Hugging Face model's weights (`[init] hf`) straight into this rank's layout.

DCP's `HuggingFaceStorageReader` presents the directory's safetensors files (one or sharded) as a
checkpoint; the model's state dict holds this rank's shards (DTensors under TP/FSDP2, only its
own layers under PP) under our names, which the family's adapter maps to Hugging Face's. DCP
then reads, from each file, only the slice each rank holds (safetensors slices), into that
rank's tensors: no rank ever holds the whole model. Values are cast on copy (bf16 files into
fp32 parameters exactly).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from models import spec_of


class PretrainedInvalid(ValueError):
    """The directory does not hold the weights the job's model needs; says which."""


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
    theirs = {spec.hf.to_hf(name): tensor for name, tensor in ours.items()}
    reader = HuggingFaceStorageReader(str(directory))
    stored = reader.read_metadata().state_dict_metadata
    missing = sorted(set(theirs) - set(stored))
    if missing:
        raise PretrainedInvalid(
            f"init.hf: {directory} lacks {len(missing)} tensor(s) the model needs, e.g. "
            f"{', '.join(missing[:3])}"
        )
    for name, tensor in theirs.items():
        size = tuple(stored[name].size)  # type: ignore[union-attr]
        if size != tuple(tensor.shape):  # a DTensor's shape is the whole tensor's
            raise PretrainedInvalid(f"init.hf: {directory}: {name} has shape {list(size)}, "
                                    f"the model's is {list(tensor.shape)}")
    dcp.load(theirs, storage_reader=reader, process_group=group)
    # DCP filled the state dict's tensors; where they are not the parameters' own memory
    # (a copy some wrapper made), hand them over.
    set_model_state_dict(model, {spec.hf.from_hf(k): v for k, v in theirs.items()},
                         options=StateDictOptions(strict=False))
