"""The global sample stream and its split over data-parallel ranks and micro-batches.

Sample i of the stream is window `perm_e[i mod n]` of the token file (n non-overlapping
windows of seq_len+1 tokens, e = i div n, perm_e a permutation seeded by (seed, e)). Step s
(0-based) consumes samples [s*G, (s+1)*G), G the job's global batch: the stream and the
sample-to-step map do not depend on the world size.

Split of a step (docs/architecture.md, "The promise" (b)): the G samples fill `dp x grad_accum x
micro_batch` slots. Slot k holds sample s*G + k; slots k >= G are zero-weight padding (all
targets ignored) so that every rank runs the same number of equally shaped micro-batches and
so issues the same collectives. Micro-batch m of dp rank r holds slots
[(m*dp + r)*mb, (m*dp + r + 1)*mb): padding lands in the last micro-batches, spread over ranks.

Context parallelism splits each micro-batch once more, along the sequence: the cp ranks of dp
rank r read r's micro-batches and each keeps its zig-zag share of the tokens of every sample
(parallel.context_parallel), inputs and targets alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ops.loss import IGNORE_INDEX
from parallel.context_parallel import shard_sequence
from parallel.job import ConfigError, DataConfig
from trainer.prepare import builtin_corpus
from trainer.tokens import TokenFileError, open_tokens


@dataclass(frozen=True)
class MicroBatch:
    inputs: torch.Tensor  # (micro_batch, seq_len) int64
    targets: torch.Tensor  # (micro_batch, seq_len) int64, IGNORE_INDEX on padding
    sample_ids: tuple[int, ...]  # global sample indices, -1 for padding slots


class SampleStream:
    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise ConfigError(
                f"data: the token file holds {len(tokens)} tokens, fewer than train.seq_len + 1"
            )
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(
                self.windows
            )
            self._perm_epoch = epoch
        return self._perm

    def sample(self, index: int) -> np.ndarray:
        """Tokens of global sample `index`: seq_len + 1 of them (inputs and shifted targets)."""
        epoch, j = divmod(index, self.windows)
        start = int(self._permutation(epoch)[j]) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)


def slot_ids(
    step: int, global_batch: int, dp: int, dp_rank: int, micro: int, micro_batch: int
) -> tuple[int, ...]:
    first = (micro * dp + dp_rank) * micro_batch
    return tuple(
        step * global_batch + k if k < global_batch else -1
        for k in range(first, first + micro_batch)
    )


def micro_batch(stream: SampleStream, ids: tuple[int, ...]) -> MicroBatch:
    rows = []
    for i in ids:
        if i < 0:
            rows.append(np.zeros(stream.seq_len + 1, dtype=np.int64))
        else:
            rows.append(stream.sample(i))
    arr = torch.from_numpy(np.stack(rows))
    inputs, targets = arr[:, :-1].clone(), arr[:, 1:].clone()
    pad = torch.tensor([i < 0 for i in ids])
    targets[pad] = IGNORE_INDEX
    return MicroBatch(inputs, targets, ids)


def step_micro_batches(
    stream: SampleStream,
    step: int,
    global_batch: int,
    dp: int,
    dp_rank: int,
    micro_batch_size: int,
    grad_accum: int,
    cp: int = 1,
    cp_rank: int = 0,
) -> list[MicroBatch]:
    """The micro-batches of 0-based `step` that dp rank `dp_rank` (cp rank `cp_rank`) runs."""
    out = []
    for m in range(grad_accum):
        mb = micro_batch(stream, slot_ids(step, global_batch, dp, dp_rank, m, micro_batch_size))
        if cp > 1:
            mb = MicroBatch(
                shard_sequence(mb.inputs, cp, cp_rank),
                shard_sequence(mb.targets, cp, cp_rank),
                mb.sample_ids,
            )
        out.append(mb)
    return out


def open_stream(data: DataConfig, seq_len: int, seed: int, vocab_size: int) -> SampleStream:
    path = (
        builtin_corpus(data.source, Path(data.cache_dir))
        if data.source
        else Path(data.path).expanduser()
    )
    try:
        tokens, header = open_tokens(path)
    except TokenFileError as exc:
        raise ConfigError(f"data.path: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"data.path: cannot open {path}: {exc.strerror}") from None
    if header.vocab_size > vocab_size:
        raise ConfigError(
            f"model.vocab_size must be >= the token file's vocabulary (got {vocab_size}, {header.vocab_size} in {path})"
        )
    return SampleStream(tokens, seq_len, seed)
