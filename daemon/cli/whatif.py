"""`ultractl plan` predictions: the planner's memory and step model for the live plan, and the
layout search on a world of the operator's choosing (`--world NODESxDEVICES --memory BYTES`).

Everything here is client-side and pure: the job comes from the live plan (or a job file), the
models from `parallel/memory_model.py`, `parallel/cost_model.py` and
`parallel/layout_search.py` (see docs/planner.md). Results are plain dicts, so `-o json` and
`-o yaml` print them as they are and the table view is only a rendering.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from parallel.cost_model import step_cost
from parallel.job import JobConfig
from parallel.layout import Layout
from parallel.layout_search import SEARCH_DIMS, Candidate, SearchSpace, World, search_layout
from parallel.memory_model import MemoryBreakdown, peak_memory
from parallel.planner import MemoryBytes, snapshot_host_bytes

DEFAULT_MEMORY = 80 * 10**9  # bytes per device when the operator does not say (an 80 GB GPU)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_TOP = 5
# A world as large as a job can use (parallel.job.MAX["parallel.dp"] nodes) and memory as large
# as ultrad accepts: bounds that keep the search finite.
MAX_NODES, MAX_DEVICES, MAX_MEMORY = 2**16, 1024, 2**50


class WhatIfError(ValueError):
    pass


def parse_world(text: str) -> World:
    """`NODESxDEVICES`, e.g. `4x8`."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if m is None:
        raise WhatIfError(f"--world: expected NODESxDEVICES such as 4x8 (got {text!r})")
    nodes, devices = int(m.group(1)), int(m.group(2))
    if nodes > MAX_NODES or devices > MAX_DEVICES:
        raise WhatIfError(f"--world: at most {MAX_NODES} nodes of {MAX_DEVICES} devices "
                          f"(got {text!r})")
    try:
        return World(nodes, devices)
    except ValueError as exc:
        raise WhatIfError(f"--world: {exc}") from None


def parse_bytes(text: str) -> int:
    """Bytes, with an optional SI (`80G`) or binary (`24GiB`) suffix."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if m is None:
        raise WhatIfError(f"--memory: expected bytes such as 80G or 24GiB (got {text!r})")
    value = float(m.group(1)) * _UNITS[m.group(2) or ""]
    if not 1 <= value <= MAX_MEMORY:  # also refuses inf
        raise WhatIfError(f"--memory: must be in [1 byte, 1 PiB] (got {text!r})")
    return int(value)


def parse_free(text: str) -> tuple[str, ...]:
    dims = tuple(d.strip() for d in text.split(",") if d.strip())
    unknown = sorted(set(dims) - set(SEARCH_DIMS))
    if unknown:
        raise WhatIfError(f"--free: unknown dimension(s) {', '.join(unknown)} "
                          f"(known: {', '.join(SEARCH_DIMS)})")
    return dims


def world_of(ranks: Iterable[dict[str, Any]]) -> World:
    """The world a live plan runs on: its nodes × the most ranks on one node."""
    per_node: dict[str, int] = {}
    for r in ranks:
        per_node[r["node"]] = per_node.get(r["node"], 0) + 1
    if not per_node:
        raise WhatIfError("the plan has no ranks")
    return World(len(per_node), max(per_node.values()))


def _memory(m: MemoryBreakdown) -> dict[str, int]:
    return {"params": m.params, "grads": m.grads, "optimizer": m.optimizer,
            "activations": m.activations, "total": m.total}


def predict(job: JobConfig, layout: Layout, devices_per_node: int) -> dict[str, Any]:
    """The model's numbers for one layout: peak memory per device and the step's costs."""
    cost = step_cost(job.model, layout, job.train.seq_len, job.train.global_batch,
                     devices_per_node)
    m = peak_memory(job.model, layout, job.train.seq_len)
    snapshots = snapshot_host_bytes(job, MemoryBytes(m.params, m.grads, m.optimizer,
                                                     m.activations), devices_per_node)
    return {"memory_bytes": _memory(m),
            "bubble_ratio": cost.bubble_ratio, "recompute_ratio": cost.recompute_ratio,
            "score": cost.efficiency, "snapshot_host_bytes": snapshots}


def _candidate(c: Candidate) -> dict[str, Any]:
    out: dict[str, Any] = {"layout": c.choice.describe()}
    if c.prediction is not None:
        out.update({"memory_bytes": _memory(c.prediction.memory),
                    "bubble_ratio": c.prediction.bubble_ratio,
                    "recompute_ratio": c.prediction.recompute_ratio,
                    "score": c.prediction.score})
    if c.reason:
        out["reason"] = c.reason
    return out


def search(job: JobConfig, world: World, memory: int, free: tuple[str, ...]) -> dict[str, Any]:
    """The layout search on `world`: the job's own dimensions, except those in `free`."""
    space = SearchSpace.from_job(job, free) if free else SearchSpace.fixed(job)
    result = search_layout(job, world, memory, space)
    return {
        "world": f"{world.nodes}x{world.devices_per_node}",
        "memory_per_device": memory,
        "free": list(free),
        "best": _candidate(result.best) if result.best else None,
        "valid": [_candidate(c) for c in result.valid[:_TOP]],
        "valid_count": len(result.valid),
        "rejected": [{"reason": reason, "candidates": n}
                     for reason, n in result.reason_counts()],
    }


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _memory_line(m: dict[str, int]) -> str:
    return (f"{_gb(m['total'])} per device (params {_gb(m['params'])}, grads "
            f"{_gb(m['grads'])}, optimizer {_gb(m['optimizer'])}, activations "
            f"{_gb(m['activations'])})")


def render(whatif: dict[str, Any], explain: bool) -> Iterable[str]:
    yield (f"layout search on {whatif['world']}, {_gb(whatif['memory_per_device'])} per "
           f"device, free: {', '.join(whatif['free']) or 'none (the job fixes its layout)'}")
    best = whatif["best"]
    if best is None:
        yield "no valid layout:"
    else:
        yield (f"best: {best['layout']}; {_memory_line(best['memory_bytes'])}; bubble "
               f"{best['bubble_ratio']:.3f}, recompute {best['recompute_ratio']:.3f}, "
               f"score {best['score']:.3f}")
    if explain or best is None:
        for i, c in enumerate(whatif["valid"][1:], start=2):
            yield f"  #{i}: {c['layout']}; score {c['score']:.3f}; {_memory_line(c['memory_bytes'])}"
        for r in whatif["rejected"]:
            yield f"  rejected ({r['candidates']}): {r['reason']}"
