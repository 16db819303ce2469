"""Ring attention on 2 and 4 gloo ranks against the single-process math reference.

Every rank draws the same full q, k, v and output gradient, computes the reference attention
and its gradients on the whole sequence, then runs ring attention on its zig-zag share and
compares its output rows and its dQ, dK, dV rows with the reference's same rows.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from daemon.procutil import free_port
from tests.forkserver import forkserver

pytestmark = pytest.mark.distributed

# (query heads, kv heads, causal)
CASES = [(4, 4, True), (4, 2, True), (6, 1, True), (4, 2, False)]


def _errors(heads: int, kv_heads: int, causal: bool, rank: int, cp: int) -> dict[str, float]:
    from ops.attention import attention_math
    from ops.ring_attention import Ring, ring_attention
    from parallel.context_parallel import shard_sequence

    seq, dim = 8 * cp, 16
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, seq, dim, generator=gen)
    k = torch.randn(2, kv_heads, seq, dim, generator=gen)
    v = torch.randn(2, kv_heads, seq, dim, generator=gen)
    dout = torch.randn(2, heads, seq, dim, generator=gen)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_math(*full, causal=causal)
    ref.backward(dout)

    def local(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, cp, rank, dim=2)

    mine = [local(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, Ring.of(dist.group.WORLD), causal=causal)
    out.backward(local(dout))
    pairs = {
        "out": (out.detach(), local(ref.detach())),
        "dq": (mine[0].grad, local(full[0].grad)),
        "dk": (mine[1].grad, local(full[1].grad)),
        "dv": (mine[2].grad, local(full[2].grad)),
    }
    return {
        name: float((got - want).abs().max() / want.abs().max())
        for name, (got, want) in pairs.items()
    }


def _rank(rank: int, cp: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, cp, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cp, timeout=timeout)
    try:
        result = {f"{h}-{kv}-{c}": _errors(h, kv, c, rank, cp) for h, kv, c in CASES}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_math_reference(cp, tmp_path):
    mp.start_processes(
        _rank, args=(cp, free_port(), str(tmp_path)), nprocs=cp, start_method=forkserver()
    )
    for rank in range(cp):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(result) == {f"{h}-{kv}-{c}" for h, kv, c in CASES}
        for case, errors in result.items():
            for name, err in errors.items():
                assert err < 1e-5, f"rank {rank}, case {case}: {name} off by {err:.1e}"
