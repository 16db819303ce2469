"""Layout search: the best tp × pp × cp × dp layout of a job on a world, with predictions.

Pure and deterministic (no torch, no I/O): the same job, world and budget give the same answer
on every agent. Every candidate is checked by `parallel.layout.resolve`, the same checks a
worker's layout goes through (heads, layers, batch, TP inside a node, pipeline schedules, what
the workers support), so the search speaks the job's terms and never returns a layout a worker
would refuse. Valid candidates whose predicted peak memory (`parallel/memory_model.py`) fits
the device are ranked by the predicted efficiency of their step (`parallel/cost_model.py`);
docs/planner.md describes the search.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from types import MappingProxyType

from parallel.cost_model import Hardware, StepCost, step_cost
from parallel.job import REPLAN_DIMS, ConfigError, JobConfig, ParallelConfig
from parallel.layout import RECOMPUTE, Layout, resolve
from parallel.memory_model import MemoryBreakdown, peak_memory

SEARCH_DIMS = REPLAN_DIMS


@dataclass(frozen=True)
class World:
    """`nodes` nodes of `devices_per_node` devices each; the search uses all of them."""

    nodes: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(
                f"world needs nodes >= 1 and devices_per_node >= 1 (got {self.nodes}, "
                f"{self.devices_per_node})"
            )

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class SearchSpace:
    """The values each dimension may take: one value fixes it, several bound it, None lets the
    world and the model decide (every value that divides what it must).

    `schedules` pairs a pipeline schedule with its virtual stages; it applies when pp > 1
    (pp = 1 takes the first pair with one virtual stage). Sequence parallelism is meaningless
    at tp = 1, which takes False unless True is the only value allowed. Context parallelism is
    opt-in (cp = 1) since it pays only for long sequences.
    """

    tp: tuple[int, ...] | None = None  # None: divisors of the devices per node and of the heads
    pp: tuple[int, ...] | None = None  # None: divisors of the layers that divide the world
    cp: tuple[int, ...] | None = (1,)  # None: divisors of the world that divide seq_len / 2
    zero: tuple[int, ...] = (1, 2, 3)
    sequence_parallel: tuple[bool, ...] = (True, False)
    schedules: tuple[tuple[str, int], ...] = (("1f1b", 1), ("interleaved_1f1b", 2))
    recompute: tuple[str, ...] = RECOMPUTE
    micro_batch: tuple[int, ...] | None = None  # None: powers of two up to the samples per dp rank
    # None: for the moe family every ep dividing both dp and num_experts; 1 for dense models.
    ep: tuple[int, ...] | None = None

    @classmethod
    def fixed(cls, job: JobConfig) -> SearchSpace:
        """Every dimension as `job` sets it: the search only evaluates the job's own layout."""
        p = job.parallel
        return cls(
            tp=(p.tp,), pp=(p.pp,), cp=(p.cp,), zero=(p.zero,),
            sequence_parallel=(p.sequence_parallel,),
            schedules=((p.pp_schedule, p.virtual_stages),), recompute=(p.recompute,),
            micro_batch=(p.micro_batch,), ep=(p.ep,),
        )

    @classmethod
    def from_job(cls, job: JobConfig, free: Collection[str]) -> SearchSpace:
        """`job`'s values, except the dimensions named in `free` (of `SEARCH_DIMS`), which take
        the defaults above."""
        unknown = sorted(set(free) - set(SEARCH_DIMS))
        if unknown:
            raise ValueError(f"unknown search dimension(s) {unknown} (known: {SEARCH_DIMS})")
        names = {"pp_schedule": "schedules"}
        defaults = cls()
        return dataclasses.replace(
            cls.fixed(job),
            **{names.get(d, d): getattr(defaults, names.get(d, d)) for d in free},
        )


@dataclass(frozen=True)
class Choice:
    """One point of the search space, in `[parallel]` terms."""

    tp: int
    pp: int
    cp: int
    zero: int
    sequence_parallel: bool
    pp_schedule: str
    virtual_stages: int
    recompute: str
    micro_batch: int
    ep: int = 1

    @classmethod
    def of(cls, layout: Layout | ParallelConfig) -> Choice:
        """The point a layout (or a job's `[parallel]` section) sits at."""
        return cls(layout.tp, layout.pp, layout.cp, layout.zero, layout.sequence_parallel,
                   layout.pp_schedule, layout.virtual_stages, layout.recompute,
                   layout.micro_batch, layout.ep)

    def parallel(self, job: JobConfig) -> JobConfig:
        """`job` with this point's `[parallel]` values (dp, precision and padding kept)."""
        return dataclasses.replace(job, parallel=dataclasses.replace(
            job.parallel, tp=self.tp, pp=self.pp, cp=self.cp, zero=self.zero,
            sequence_parallel=self.sequence_parallel, pp_schedule=self.pp_schedule,
            virtual_stages=self.virtual_stages, recompute=self.recompute,
            micro_batch=self.micro_batch, ep=self.ep))

    def describe(self) -> str:
        sp = " sp" if self.sequence_parallel else ""
        pipe = f" {self.pp_schedule} v{self.virtual_stages}" if self.pp > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return (f"tp{self.tp}{sp} pp{self.pp}{pipe} cp{self.cp}{ep} zero{self.zero} "
                f"recompute={self.recompute} micro_batch={self.micro_batch}")


@dataclass(frozen=True)
class Prediction:
    memory: MemoryBreakdown  # the pipeline rank with the largest total
    step: StepCost

    @property
    def bubble_ratio(self) -> float:
        return self.step.bubble_ratio

    @property
    def recompute_ratio(self) -> float:
        return self.step.recompute_ratio

    @property
    def score(self) -> float:
        """Predicted useful compute time / step time, in (0, 1]; higher is better."""
        return self.step.efficiency


@dataclass(frozen=True)
class Candidate:
    choice: Choice
    layout: Layout | None = None  # None when `resolve` refused the choice
    memory: MemoryBreakdown | None = None  # predicted whenever there is a layout
    prediction: Prediction | None = None  # valid candidates only
    reason: str = ""  # why it is not valid; empty when it is

    @property
    def valid(self) -> bool:
        return not self.reason


@dataclass(frozen=True)
class SearchResult:
    world: World
    memory_per_device: int
    best: Candidate | None
    # Valid candidates best first, then the rejected ones in search order with their reasons.
    candidates: tuple[Candidate, ...]

    @property
    def valid(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.valid)

    @property
    def rejected(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if not c.valid)

    def reason_counts(self) -> tuple[tuple[str, int], ...]:
        """Distinct rejection reasons, most frequent first (memory reasons grouped)."""
        kinds = Counter(_reason_kind(c.reason) for c in self.rejected)
        return tuple(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


MEMORY_REASON = "predicted memory exceeds the device"


def _reason_kind(reason: str) -> str:
    return MEMORY_REASON if reason.startswith(MEMORY_REASON) else reason


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _or(values: tuple[int, ...] | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return default if values is None else values


def _choices(job: JobConfig, world: World, space: SearchSpace) -> list[Choice]:
    """Every point of `space` on `world`, in a fixed order (structure first, then options)."""
    model, seq = job.model, job.train.seq_len
    heads = (model.num_attention_heads, model.num_key_value_heads)
    tps = _or(space.tp, tuple(
        t for t in _divisors(world.devices_per_node) if all(h % t == 0 for h in heads)))
    out: list[Choice] = []
    for tp in tps:
        rest = world.devices // tp if world.devices % tp == 0 else 1
        pps = _or(space.pp, tuple(
            p for p in _divisors(rest) if model.num_hidden_layers % p == 0))
        for pp in pps:
            rest_cp = rest // pp if rest % pp == 0 else 1
            cps = _or(space.cp, tuple(
                c for c in _divisors(rest_cp) if c == 1 or seq % (2 * c) == 0))
            for cp in cps:
                out.extend(_options(job, world, space, tp, pp, cp))
    return out


def _options(
    job: JobConfig, world: World, space: SearchSpace, tp: int, pp: int, cp: int
) -> list[Choice]:
    sps = space.sequence_parallel
    if tp == 1:
        sps = (True,) if sps == (True,) else (False,)
    schedules = space.schedules
    if pp == 1:
        single = [s for s in schedules if s[1] == 1]
        schedules = (single[0] if single else schedules[0],)
    inner = tp * pp * cp
    dp = max(1, world.devices // inner)
    per_rank = -(-job.train.global_batch // dp)
    mbs = _or(space.micro_batch, tuple(1 << k for k in range(per_rank.bit_length())))
    experts = job.model.num_experts if job.model.family == "moe" else 1
    eps = _or(space.ep, tuple(e for e in _divisors(dp) if experts % e == 0))
    return [
        Choice(tp, pp, cp, zero, sp, sched, v, rc, mb, ep)
        for ep in eps for sp in sps for (sched, v) in schedules for mb in mbs
        for zero in space.zero for rc in space.recompute
    ]


def _evaluate(
    job: JobConfig, world: World, budget: int, choice: Choice, hardware: Hardware
) -> Candidate:
    if choice.micro_batch > job.train.global_batch:
        return Candidate(choice, reason=(
            f"parallel.micro_batch must be <= train.global_batch "
            f"(got {choice.micro_batch}, {job.train.global_batch})"))
    try:
        layout = resolve(choice.parallel(job), world.devices,
                         devices_per_node=world.devices_per_node)
    except ConfigError as exc:
        return Candidate(choice, reason=str(exc))
    memory = peak_memory(job.model, layout, job.train.seq_len)
    if memory.total > budget:
        return Candidate(choice, layout, memory, reason=(
            f"{MEMORY_REASON}: {_gb(memory.total)} > {_gb(budget)} (params "
            f"{_gb(memory.params)}, grads {_gb(memory.grads)}, optimizer "
            f"{_gb(memory.optimizer)}, activations {_gb(memory.activations)})"))
    cost = step_cost(job.model, layout, job.train.seq_len, job.train.global_batch,
                     world.devices_per_node, hardware)
    return Candidate(choice, layout, memory, Prediction(memory, cost))


_RECOMPUTE_ORDER = MappingProxyType({name: i for i, name in enumerate(RECOMPUTE)})


def _rank_key(c: Candidate) -> tuple[float | int | str | bool, ...]:
    """Best score first; equal scores (to 1e-9) go to the simpler layout: less model
    parallelism, less recompute, a lower ZeRO stage, then the remaining fields in order."""
    assert c.prediction is not None
    ch = c.choice
    return (
        -round(c.prediction.score, 9), ch.tp * ch.pp * ch.cp, ch.pp, ch.tp, ch.cp, ch.ep,
        _RECOMPUTE_ORDER[ch.recompute], ch.zero, ch.virtual_stages, ch.pp_schedule,
        ch.sequence_parallel, ch.micro_batch,
    )


def search_layout(
    job: JobConfig,
    world: World,
    memory_per_device: int,
    space: SearchSpace | None = None,
    hardware: Hardware | None = None,
) -> SearchResult:
    """The best layout of `job` on all of `world`'s devices within `memory_per_device` bytes.

    `space` defaults to every dimension free except cp (`SearchSpace()`); pass
    `SearchSpace.fixed(job)` or `SearchSpace.from_job(job, free=...)` to keep the job's own
    choices. The job's `parallel.dp`, `mixed_precision` and `pad_uneven` always apply. When no
    candidate is valid, `best` is None and every candidate carries its reason.
    """
    if memory_per_device < 1:
        raise ValueError(f"memory_per_device must be >= 1 byte (got {memory_per_device})")
    hw = hardware or Hardware()
    evaluated = [
        _evaluate(job, world, memory_per_device, choice, hw)
        for choice in _choices(job, world, space or SearchSpace())
    ]
    valid = sorted((c for c in evaluated if c.valid), key=_rank_key)
    rejected = [c for c in evaluated if not c.valid]
    return SearchResult(
        world=world, memory_per_device=memory_per_device,
        best=valid[0] if valid else None, candidates=(*valid, *rejected),
    )
