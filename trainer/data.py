"""The global sample stream and its split over data-parallel ranks and micro-batches.

Global sample i comes from source k at position j of that source, (k, j) = `origin(i)`: with one
token file (`data.path`, `data.source`) k = 0 and j = i; a blend (`[[data.sources]]`) picks k by
weight, a pure function of (seed, i, weights) (trainer.blend). Position j of a source is window
`perm_e[j mod n]` of its token file (n non-overlapping windows of seq_len+1 tokens, e = j div n,
perm_e a permutation seeded by (seed, e) for source 0 and (seed, e, k) for source k > 0).
Windows are packed across documents: a sample may span a document's end, its EOS and the next
document's start (docs/data.md). Step s (0-based) consumes samples [s*G, (s+1)*G), G the job's
global batch: the stream and the sample-to-step map do not depend on the world size.

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

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ops.loss import IGNORE_INDEX
from parallel.context_parallel import shard_sequence
from parallel.job import ConfigError, DataConfig
from trainer.blend import Blend
from trainer.prepare import builtin_corpus
from trainer.tokens import TokenFileError, TokenFileHeader, open_documents, open_tokens


@dataclass(frozen=True)
class MicroBatch:
    inputs: torch.Tensor  # (micro_batch, seq_len) int64
    targets: torch.Tensor  # (micro_batch, seq_len) int64, IGNORE_INDEX on padding
    sample_ids: tuple[int, ...]  # global sample indices, -1 for padding slots


class TokenWindows:
    """One token file cut into non-overlapping windows, in a seeded order per epoch."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        seed: tuple[int, ...],
        documents: np.ndarray | None = None,
        name: str = "the token file",
    ) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.documents = documents  # token offsets where documents start; None: unknown
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise ConfigError(
                f"data: {name} holds {len(tokens)} tokens, fewer than train.seq_len + 1"
            )
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.Generator(
                np.random.PCG64([self.seed[0], epoch, *self.seed[1:]])
            ).permutation(self.windows)
            self._perm_epoch = epoch
        return self._perm

    def sample(self, position: int) -> np.ndarray:
        epoch, j = divmod(position, self.windows)
        start = int(self._permutation(epoch)[j]) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)


class SampleStream:
    """The global sample stream over one token file or a weighted blend of several."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self._init([TokenWindows(tokens, seq_len, (seed,))], None, seq_len, seed)

    @classmethod
    def blend(
        cls, sources: list[TokenWindows], weights: list[float], seq_len: int, seed: int
    ) -> SampleStream:
        stream = cls.__new__(cls)
        stream._init(sources, Blend(weights, seed) if len(sources) > 1 else None, seq_len, seed)
        return stream

    def _init(
        self, sources: list[TokenWindows], blend: Blend | None, seq_len: int, seed: int
    ) -> None:
        self.sources, self._blend, self.seq_len, self.seed = sources, blend, seq_len, seed
        self.windows = sum(s.windows for s in sources)
        self.trace: SampleTrace | None = None

    def origin(self, index: int) -> tuple[int, int]:
        """(source, position within the source) of global sample `index`."""
        return (0, index) if self._blend is None else self._blend.origin(index)

    def sample(self, index: int) -> np.ndarray:
        """Tokens of global sample `index`: seq_len + 1 of them (inputs and shifted targets)."""
        k, position = self.origin(index)
        return self.sources[k].sample(position)


class SampleTrace:
    """A testing aid: `ULTRA_DATA_TRACE=DIR` makes every process append one JSON line per
    micro-batch it reads (step, dp, dp rank, cp rank, sample ids and their origins) to
    `DIR/<pid>.jsonl`, so a test can check which samples a real run read. Unset: no effect."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"{os.getpid()}.jsonl"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SampleTrace | None:
        raw = env.get("ULTRA_DATA_TRACE", "").strip()
        return cls(Path(raw)) if raw else None

    def record(self, stream: SampleStream, mb: MicroBatch, **where: int) -> None:
        origins = [list(stream.origin(i)) if i >= 0 else None for i in mb.sample_ids]
        line = json.dumps({**where, "ids": list(mb.sample_ids), "origins": origins})
        with open(self.path, "a") as f:
            f.write(line + "\n")


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
        if stream.trace is not None:
            stream.trace.record(
                stream, mb, step=step, dp=dp, dp_rank=dp_rank, cp_rank=cp_rank, micro=m
            )
        if cp > 1:
            mb = MicroBatch(
                shard_sequence(mb.inputs, cp, cp_rank),
                shard_sequence(mb.targets, cp, cp_rank),
                mb.sample_ids,
            )
        out.append(mb)
    return out


def _open_source(path: Path, field: str, vocab_size: int) -> tuple[np.ndarray, TokenFileHeader]:
    try:
        tokens, header = open_tokens(path)
    except TokenFileError as exc:
        raise ConfigError(f"{field}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{field}: cannot open {path}: {exc.strerror}") from None
    if header.vocab_size > vocab_size:
        raise ConfigError(
            f"model.vocab_size must be >= the token file's vocabulary (got {vocab_size}, {header.vocab_size} in {path})"
        )
    return tokens, header


def _tokenizer_identity(header: TokenFileHeader) -> str:
    return header.tokenizer_sha256 or header.tokenizer


def open_stream(
    data: DataConfig, seq_len: int, seed: int, vocab_size: int, section: str = "data"
) -> SampleStream:
    """The stream of `data`; `section` names its fields in errors ("eval" for [eval])."""
    if data.sources:
        named = [(Path(s.path).expanduser(), f"{section}.sources[{i}].path")
                 for i, s in enumerate(data.sources)]
        weights = [s.weight for s in data.sources]
    elif data.source:
        named = [(builtin_corpus(data.source, Path(data.cache_dir)), "data.source")]
        weights = [1.0]
    else:
        named = [(Path(data.path).expanduser(), f"{section}.path")]
        weights = [1.0]
    sources, first = [], None
    for k, (path, field) in enumerate(named):
        tokens, header = _open_source(path, field, vocab_size)
        if first is None:
            first = header
        elif _tokenizer_identity(header) != _tokenizer_identity(first):
            raise ConfigError(
                f"{field}: {path} was tokenized with {header.tokenizer!r}, "
                f"{named[0][1]} with {first.tokenizer!r}: a blend needs one tokenizer"
            )
        seed_key = (seed,) if k == 0 else (seed, k)
        sources.append(
            TokenWindows(tokens, seq_len, seed_key, open_documents(path, header), f"{field} {path}")
        )
    stream = SampleStream.blend(sources, weights, seq_len, seed)
    stream.trace = SampleTrace.from_env(os.environ)
    return stream
