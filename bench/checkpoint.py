"""DCP checkpoint throughput against raw disk, reshard-load 4→3 against 4→4, and manifest cost.

    python -m bench.checkpoint [--runs 3] [--size-mb 50] [--dir DIR]
    python -m bench.checkpoint --integrity [--size-mb 2048] [--ranks 1,2,4]   (bench/checkpoint_integrity.py)

A few-M-parameter MLP under FSDP2 (`fully_shard` per layer and the root) with Adam state after one
step is saved by 4 gloo ranks with `torch.distributed.checkpoint.save`. "Raw disk" is the same ranks
writing the same number of bytes to one file each and fsyncing it (DCP's FileSystemWriter fsyncs
too, `sync_files=True`), then reading them back. Loads go into a differently-initialised model on 4
ranks (same layout) and on 3 ranks (resharded by DCP's planner); every load is checked to equal
the saved state exactly. When permitted, the page cache is dropped before every read so reads
come from disk; the output says whether it was.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench.ranks import timed_across_ranks
from checkpoint.manifest import verify, write_manifest
from daemon.procutil import free_port

SAVE_WORLD = 4
RESHARD_WORLD = 3
WIDTH = 1024
# Model + Adam's two moments: three fp32 copies of every parameter.
BYTES_PER_PARAM = 3 * 4
MB = 1e6


# --- inside a rank ----------------------------------------------------------------------------


def _init_rank(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)  # 4 ranks share 2 cores; more threads only thrash
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )


def _build(world: int, n_layers: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded MLP with Adam state after one step; `seed` decides every value."""
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(n_layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, WIDTH)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _sharded_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    # A collective: every rank gathers, rank 0 ends up with full tensors on CPU.
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optim, options=opts)
    return {"model": msd, "optim": osd}


def _assert_same(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), f"{where} differs"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys differ"
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: lengths differ"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _scramble(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Zero parameters and optimizer state, so the next load has to bring every value back."""
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for per_param in optim.state.values():
            for value in per_param.values():
                value.zero_()



def _drop_page_cache() -> bool:
    os.sync()  # dirty pages are not dropped; write them back first
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def _before_read(rank: int, drop: bool) -> None:
    if drop and rank == 0:
        _drop_page_cache()
    dist.barrier()


def _raw_write(path: Path, data: bytes) -> None:
    with open(path, "wb", buffering=0) as f:
        f.write(data)
        os.fsync(f.fileno())


def _raw_read(path: Path, buf: bytearray) -> None:
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        while view:
            n = f.readinto(view)
            if not n:
                raise EOFError(f"{path} is shorter than {len(buf)} bytes")
            view = view[n:]


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _save_worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """Save `runs` checkpoints and time them against raw per-rank write+fsync and read."""
    _init_rank(rank, world, port)
    work = Path(cfg["work"])
    model, optim = _build(world, cfg["n_layers"], seed=0)
    full = _full_state(model, optim)
    if rank == 0:
        torch.save(full, work / "reference.pt")
    state = _sharded_state(model, optim)
    times: dict[str, list[float]] = {"save": [], "raw_write": [], "raw_read": []}
    for run in range(cfg["runs"]):
        ckpt = work / f"ckpt_{run}"
        times["save"].append(timed_across_ranks(lambda ckpt=ckpt: dcp.save(state, checkpoint_id=ckpt)))
        per_rank = _dir_bytes(ckpt) // world
        data = os.urandom(per_rank)  # incompressible, generated outside the timer
        raw = work / f"raw_{run}_rank{rank}.bin"
        times["raw_write"].append(timed_across_ranks(lambda raw=raw, data=data: _raw_write(raw, data)))
        _before_read(rank, cfg["drop"])
        buf = bytearray(per_rank)
        times["raw_read"].append(timed_across_ranks(lambda raw=raw, buf=buf: _raw_read(raw, buf)))
        raw.unlink()
    if rank == 0:
        result = {"times": times, "ckpt_bytes": _dir_bytes(work / "ckpt_0"), "raw_bytes": per_rank}
        (work / f"result_save_{world}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _load_worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    """Load every saved checkpoint into a differently-seeded model on `world` ranks."""
    _init_rank(rank, world, port)
    work = Path(cfg["work"])
    model, optim = _build(world, cfg["n_layers"], seed=1)
    reference = torch.load(work / "reference.pt") if rank == 0 else None
    times: list[float] = []
    for run in range(cfg["runs"]):
        state = _sharded_state(model, optim)
        _before_read(rank, cfg["drop"])
        ckpt = work / f"ckpt_{run}"
        times.append(timed_across_ranks(lambda ckpt=ckpt, sd=state: dcp.load(sd, checkpoint_id=ckpt)))
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        loaded = _full_state(model, optim)
        if rank == 0:
            _assert_same(loaded, reference)
        _scramble(model, optim)
    if rank == 0:
        (work / f"result_load_{world}.json").write_text(json.dumps({"times": times}))
    dist.destroy_process_group()


# --- the driver -------------------------------------------------------------------------------


def _spawn(worker: Callable[..., None], world: int, cfg: dict[str, Any]) -> None:
    mp.spawn(worker, args=(world, free_port(), cfg), nprocs=world, join=True)


def _manifest_times(work: Path, runs: int, drop: bool) -> dict[str, list[float]]:
    """Our manifest on each saved checkpoint, computed by one process (a tool's view): commit
    (read, crc32c, fsync every file), full and sizes-only verify."""
    times: dict[str, list[float]] = {"write": [], "verify": [], "verify_sizes": []}
    for run in range(runs):
        ckpt = work / f"ckpt_{run}"
        steps = [
            ("write", lambda c=ckpt: write_manifest(c, step=0, consumed_samples=0, layout={})),
            ("verify", lambda c=ckpt: verify(c)),
            ("verify_sizes", lambda c=ckpt: verify(c, checksums=False)),
        ]
        for name, fn in steps:
            if drop:
                _drop_page_cache()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _row(name: str, ranks: str, nbytes: int, seconds: list[float], raw_mbps: float | None) -> str:
    median = statistics.median(seconds)
    mbps = nbytes / MB / median
    ratio = "-" if raw_mbps is None else f"{mbps / raw_mbps:.2f}"
    return f"{name:<34} {ranks:>5} {nbytes / MB:>7.1f} {median:>9.3f} {mbps:>9.1f} {ratio:>8}"


def _report(
    save: dict[str, Any],
    load4: list[float],
    load3: list[float],
    manifest: dict[str, list[float]],
    drop: bool,
    runs: int,
) -> None:
    ckpt, raw = save["ckpt_bytes"], save["raw_bytes"] * SAVE_WORLD
    t = save["times"]
    write_mbps = raw / MB / statistics.median(t["raw_write"])
    read_mbps = raw / MB / statistics.median(t["raw_read"])
    cache = "dropped before every read" if drop else "NOT dropped (not permitted): reads may hit it"
    print(f"# medians of {runs} runs; page cache {cache}")
    print("# vs raw = MB/s of the operation / MB/s of raw disk doing the same kind of I/O")
    print(f"{'operation':<34} {'ranks':>5} {'MB':>7} {'median s':>9} {'MB/s':>9} {'vs raw':>8}")
    lines = [
        _row("raw write + fsync", "4", raw, t["raw_write"], write_mbps),
        _row("DCP save (fsync)", "4", ckpt, t["save"], write_mbps),
        _row("raw read", "4", raw, t["raw_read"], read_mbps),
        _row("DCP load 4→4 (same layout)", "4", ckpt, load4, read_mbps),
        _row("DCP load 4→3 (reshard)", "3", ckpt, load3, read_mbps),
        _row("manifest write (crc32c + fsync)", "1", ckpt, manifest["write"], read_mbps),
        _row("manifest verify (crc32c)", "1", ckpt, manifest["verify"], read_mbps),
        _row("manifest verify (sizes only)", "1", ckpt, manifest["verify_sizes"], None),
    ]
    print("\n".join(lines))
    ratio = statistics.median(load3) / statistics.median(load4)
    print(f"reshard load 4→3 / same-layout 4→4 (median seconds): {ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.checkpoint", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per measurement (median; >= 3)")
    parser.add_argument("--size-mb", type=float, default=50.0, help="model + Adam state, in MB")
    parser.add_argument("--dir", type=Path, default=None, help="where to make the scratch dir")
    parser.add_argument("--integrity", action="store_true",
                        help="checksum speed, and verify/restore time by world size at one total")
    parser.add_argument("--ranks", default="1,2,4", help="world sizes for --integrity")
    args = parser.parse_args(argv)
    if args.runs < 3 or args.size_mb <= 0:
        parser.error("--runs must be >= 3 and --size-mb > 0")
    if args.dir is not None and not Path(args.dir).is_dir():
        parser.error(f"--dir {args.dir}: no such directory")
    # Each rank's own store; no sharing with a torchrun rendezvous that does not exist here.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if args.integrity:
        from bench.checkpoint_integrity import run

        work = Path(tempfile.mkdtemp(prefix="ultrascale-bench-integrity-", dir=args.dir))
        try:
            run(work, args.size_mb, [int(n) for n in args.ranks.split(",")], args.runs)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return 0
    n_layers = max(1, round(args.size_mb * MB / (BYTES_PER_PARAM * WIDTH * (WIDTH + 1))))
    work = Path(tempfile.mkdtemp(prefix="ultrascale-bench-ckpt-", dir=args.dir))
    try:
        drop = _drop_page_cache()
        cfg = {"work": str(work), "runs": args.runs, "n_layers": n_layers, "drop": drop}
        print(f"# {n_layers} x Linear({WIDTH}, {WIDTH}) + Adam, scratch {work}", file=sys.stderr)
        _spawn(_save_worker, SAVE_WORLD, cfg)
        _spawn(_load_worker, SAVE_WORLD, cfg)
        _spawn(_load_worker, RESHARD_WORLD, cfg)
        manifest = _manifest_times(work, args.runs, drop)
        save = json.loads((work / f"result_save_{SAVE_WORLD}.json").read_text())
        load4 = json.loads((work / f"result_load_{SAVE_WORLD}.json").read_text())["times"]
        load3 = json.loads((work / f"result_load_{RESHARD_WORLD}.json").read_text())["times"]
        _report(save, load4, load3, manifest, drop, args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
