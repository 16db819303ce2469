"""The held-out set of `[eval]` and its split over the layout (docs/data.md, "Evaluation").

The held-out set is samples 0..samples-1 of the eval stream, a `SampleStream` built from
`eval.path` or `[[eval.sources]]` exactly as the training stream is built from `[data]` (same
seq_len and seed), but a separate object: evaluating never moves the training stream.

An evaluation runs in rounds shaped like a training step of the layout, `dp x grad_accum x
micro_batch` slots each, so the pipeline schedule runs it with the step's micro-batch count:
round c's slot k holds sample c*B + k (B the slots of a round), and slots past the held-out set
are zero-weight padding, as in a padded training step (trainer/data.py). Every rank runs the
same number of rounds and micro-batches, so every rank issues the same collectives.

The loss is normalised as training's (trainer/loop.py): each micro-batch's token-summed loss is
divided by the held-out set's target token count (samples x seq_len), and the sum over every
micro-batch of every rank is the mean token loss of the set, whatever the layout.
"""

from __future__ import annotations

from parallel.context_parallel import shard_sequence
from parallel.job import DataConfig, EvalConfig, JobConfig
from trainer.data import MicroBatch, SampleStream, micro_batch, open_stream, slot_ids


def open_eval_stream(cfg: JobConfig) -> SampleStream | None:
    """The eval stream of the job, None when `[eval]` is off."""
    e: EvalConfig = cfg.eval
    if not e.every:
        return None
    data = DataConfig(path=e.path, sources=e.sources)
    stream = open_stream(data, cfg.train.seq_len, cfg.train.seed, cfg.model.vocab_size, "eval")
    stream.trace = None  # ULTRA_DATA_TRACE records what training reads
    return stream


def eval_due(e: EvalConfig, step: int) -> bool:
    """Whether an evaluation follows 1-based `step` (after its update)."""
    return e.every > 0 and step % e.every == 0


def eval_rounds(samples: int, dp: int, micro_batch_size: int, grad_accum: int) -> int:
    return -(-samples // (dp * micro_batch_size * grad_accum))


def eval_micro_batches(
    stream: SampleStream,
    round_: int,
    samples: int,
    dp: int,
    dp_rank: int,
    micro_batch_size: int,
    grad_accum: int,
    cp: int = 1,
    cp_rank: int = 0,
) -> list[MicroBatch]:
    """The micro-batches of evaluation round `round_` that dp rank `dp_rank` (cp rank
    `cp_rank`) runs; sample ids >= `samples` are padding (-1)."""
    per_round = dp * micro_batch_size * grad_accum
    out = []
    for m in range(grad_accum):
        ids = slot_ids(round_, per_round, dp, dp_rank, m, micro_batch_size)
        mb = micro_batch(stream, tuple(i if i < samples else -1 for i in ids))
        if cp > 1:
            mb = MicroBatch(
                shard_sequence(mb.inputs, cp, cp_rank),
                shard_sequence(mb.targets, cp, cp_rank),
                mb.sample_ids,
            )
        out.append(mb)
    return out

