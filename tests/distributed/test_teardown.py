"""A surviving worker re-forms the world in-process without leaking the old one.

Two real processes run three generations each (new TCPStore port per generation, FSDP2 model,
two steps, teardown); no socket survives a teardown and threads and fds after the third equal
those after the first.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from daemon.procutil import free_port, free_ports
from parallel.job import JobConfig, load
from parallel.layout import resolve
from parallel.mesh import build_mesh
from tests.conftest import small_job_text
from tests.forkserver import forkserver
from trainer.loop import Trainer
from trainer.teardown import Teardown, freeze_import_heap, leave_world

pytestmark = pytest.mark.distributed


def _resources() -> tuple[int, int, int]:
    import threading

    targets = []
    for fd in os.listdir("/proc/self/fd"):
        # the fd that listed the directory is already closed when we read it
        with contextlib.suppress(FileNotFoundError):
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return threading.active_count(), len(targets), sum(t.startswith("socket:") for t in targets)


def _form_world(cfg: JobConfig, rank: int, port: int) -> Trainer:
    """A two-rank world on a fresh TCPStore port, and a trainer on it."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    layout = resolve(cfg, 2)
    return Trainer(cfg, layout, build_mesh(layout, "cpu", timedelta(seconds=60)),
                   torch.device("cpu"))


def _worker(rank: int, job: str, ports: list[int], out: str) -> None:
    torch.set_num_threads(1)
    freeze_import_heap()  # as trainer.worker does: what is frozen must not pin a generation
    cfg = load(job)
    counts = [_resources()]
    for port in ports:
        trainer = _form_world(cfg, rank, port)
        for _ in range(2):
            trainer.train_step()
        del trainer
        leave_world()
        counts.append(_resources())
    if rank == 0:
        torch.save({"counts": counts}, out)


def test_three_generations_leave_nothing_behind(token_file: Path, tmp_path: Path):
    job = tmp_path / "job.toml"
    job.write_text(small_job_text(token_file))
    out = tmp_path / "out.pt"
    mp.start_processes(
        _worker,
        args=(str(job), free_ports(3), str(out)),
        nprocs=2,
        start_method=forkserver(),
    )
    result = torch.load(out, weights_only=False)
    baseline, first, *_, last = result["counts"]
    # (threads, fds, sockets): no socket of any generation survives its teardown, and nothing
    # accumulates from one generation to the next.
    assert all(sockets == 0 for _, _, sockets in result["counts"]), result["counts"]
    assert last == first, (
        f"after generation 1 {first}, after generation 3 {last} (before: {baseline})"
    )


def _survivor(rank: int, job: str, ports: list[int], out: str) -> None:
    """As trainer.worker does: leave each world, and free it after the next one's first step."""
    import weakref

    torch.set_num_threads(1)
    freeze_import_heap()
    cfg = load(job)
    teardown = Teardown()
    teardown.refresh()
    counts, held, alive_after_release, losses = [], [], [], []
    for port in ports:
        trainer = _form_world(cfg, rank, port)
        losses.append(trainer.train_step().loss)
        left = [weakref.ref(g) for g in teardown.held]
        teardown.release()
        alive_after_release.append(sum(ref() is not None for ref in left))
        losses.append(trainer.train_step().loss)
        groups = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]
        del trainer
        teardown.leave()
        held.append((len(groups), sum(ref() is not None for ref in groups)))
    teardown.release()
    counts.append(_resources())
    if rank == 0:
        torch.save({"counts": counts, "held": held, "released": alive_after_release,
                    "losses": losses}, out)


def test_a_world_left_is_held_until_the_next_one_has_stepped_then_freed(token_file: Path,
                                                                        tmp_path: Path):
    job = tmp_path / "job.toml"
    job.write_text(small_job_text(token_file))
    out = tmp_path / "out.pt"
    mp.start_processes(_survivor, args=(str(job), free_ports(3), str(out)),
                       nprocs=2, start_method=forkserver())
    result = torch.load(out, weights_only=False)
    # Each world's groups outlive its teardown (nothing to free on the critical path) ...
    assert all(n > 0 and alive == n for n, alive in result["held"]), result["held"]
    # ... and are freed once the next world has taken a step: nothing of theirs remains.
    assert result["released"] == [0, 0, 0]
    assert [sockets for _, _, sockets in result["counts"]] == [0]
    # Each generation trains the same two steps from the same seed, held worlds or not.
    losses = result["losses"]
    assert losses[0:2] == losses[2:4] == losses[4:6]


def test_a_failed_join_does_not_shift_group_names():
    """A join whose peers never come must not change how the next generation names its groups."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=1))
    fresh_name = dist.distributed_c10d._world.group_count
    with pytest.raises(dist.DistError):
        dist.init_process_group("gloo", store=dist.PrefixStore("generation/7", store), rank=0, world_size=2,
                                timeout=timedelta(seconds=1))
    leave_world()
    assert dist.distributed_c10d._world.group_count == fresh_name == 0


def _dies_mid_step(rank: int, job: str, port: int, delay: float, out: str) -> None:
    """Three ranks train with the memory meter on; rank 2 exits `delay` s into step 3."""
    import threading
    import weakref

    from trainer.memory_meter import MemoryMeter

    torch.set_num_threads(1)
    freeze_import_heap()
    cfg = load(job)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3,
                            timeout=timedelta(seconds=30))
    layout = resolve(cfg, 3)
    mesh = build_mesh(layout, "cpu", timedelta(seconds=30))

    def train(mesh: DeviceMesh) -> None:
        trainer = Trainer(cfg, layout, mesh, torch.device("cpu"))
        meter = MemoryMeter(trainer.model, trainer.optimizer, torch.device("cpu"))
        for step in range(8):
            if rank == 2 and step == 3:
                threading.Timer(delay, os._exit, (0,)).start()
            with meter.measure():
                trainer.train_step()

    try:
        train(mesh)
        error = ""
    except RuntimeError as exc:
        error = str(exc)[:200]
    groups = [(name, weakref.ref(g)) for g, name in dist.distributed_c10d._world.pg_names.items()]
    del mesh, store
    leave_world()
    torch.save({"error": error, "alive": [n for n, ref in groups if ref() is not None]},
               f"{out}.{rank}")


@pytest.mark.parametrize("delay", [0.02, 0.08])
def test_a_step_that_fails_mid_way_leaves_no_group_alive(token_file: Path, tmp_path: Path,
                                                         delay: float):
    """A peer dies inside a step measured by the memory meter (whose saved-tensor hooks are what
    autograd keeps of the step): the survivors' teardown frees every group of the old world,
    so their connections close at once."""
    job = tmp_path / "job.toml"
    job.write_text(small_job_text(token_file))
    out = tmp_path / "out"
    mp.start_processes(_dies_mid_step, args=(str(job), free_port(), delay, str(out)), nprocs=3,
                       start_method=forkserver())
    for rank in (0, 1):
        result = torch.load(f"{out}.{rank}")
        assert result["error"], f"rank {rank} did not see rank 2 die"
        assert result["alive"] == [], f"rank {rank}: groups {result['alive']} outlived the teardown"


def _blocked_on_a_survivor(rank: int, port: int, out: str) -> None:
    """Rank 2 exits; rank 1's collective with it fails and rank 1 severs its connections but
    keeps every group alive; rank 0 waits on a collective of rank 0 and 1 only."""
    import time

    from trainer.teardown import sever_connections

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=60))
    # A long timeout: rank 0's wait must end by the severed connection, never by the timeout.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3,
                            timeout=timedelta(seconds=120))
    pair = dist.new_group([0, 1])
    dist.barrier()
    failed = Path(f"{out}.rank0-failed")
    if rank == 2:
        # Not before ranks 0 and 1 are out of the barrier: gloo may fail a pair whose peer has
        # hung up before it reads what the peer sent last, and their barrier would raise.
        store.wait(["past-barrier/0", "past-barrier/1"])
        os._exit(0)
    store.set(f"past-barrier/{rank}", "1")
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(4), group=pair)  # rank 1 never takes part
            error = ""
        except RuntimeError as exc:
            error = str(exc)[:200]
        failed.write_text(error)
        # Out without freeing the groups: what is tested has been recorded, and interpreter
        # shutdown destroying a gloo group whose pair failed may abort the process
        # ("terminate called without an active exception", seen once in a CI run).
        os._exit(0)
    # Rank 1 failed once in CI without writing its result: whatever ends or holds it from here
    # leaves its cause behind (an exception's traceback, or every thread's stack after 60 s).
    import faulthandler
    import traceback

    with open(f"{out}.rank1-stacks", "w") as stacks:
        faulthandler.dump_traceback_later(60, file=stacks)
        try:
            try:
                dist.all_reduce(torch.ones(4))
                error = ""
            except RuntimeError as exc:
                error = str(exc)[:200]
            severed = sever_connections()
            deadline = time.monotonic() + 30
            while not failed.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            torch.save({"error": error, "severed": severed, "peer_failed": failed.exists()}, out)
        except BaseException:
            Path(f"{out}.rank1-error").write_text(traceback.format_exc())
            raise
        finally:
            faulthandler.cancel_dump_traceback_later()
    os._exit(0)  # as rank 0: the result is on disk, the failed groups are never freed


def test_a_failed_rank_severs_its_connections_so_peers_blocked_on_it_fail_at_once(
        tmp_path: Path):
    """gloo closes a group's connections only when the group is freed. A rank whose collective
    failed severs them first: a peer waiting on it (not on the dead rank) fails while the rank
    still holds every group, instead of at its process-group timeout."""
    out = tmp_path / "out"
    context = mp.start_processes(_blocked_on_a_survivor, args=(free_port(), str(out)),
                                 nprocs=3, start_method=forkserver(), join=False)
    try:
        while not context.join():  # returns as each process ends (rank 1 within 30 s)
            pass
    finally:
        if not out.exists():  # what rank 1 left of its cause, in the failure's report
            for name in ("out.rank1-error", "out.rank1-stacks", "out.rank0-failed"):
                path = tmp_path / name
                if path.exists():
                    print(f"--- {name}:\n{path.read_text()[-4000:]}")
    result = torch.load(out)
    assert result["error"], "rank 1 did not see rank 2 exit"
    assert result["severed"] > 0
    assert result["peer_failed"], "rank 0 stayed blocked on rank 1 after rank 1 severed"
    assert (tmp_path / "out.rank0-failed").read_text(), "rank 0's collective returned"


class _Quiet:
    def step(self, result: object, dp: int) -> None:
        pass


def _torchrun_rank(rank: int, job: str, port: int, out: str) -> None:
    """`python -m trainer` under torchrun, as far as `trainer.run.run`: its world must be freed
    by the time it returns, while the interpreter is alive. Left to interpreter shutdown, a
    gloo group's worker threads can abort the process (SIGABRT, "terminate called without an
    active exception") after a run that trained to the end."""
    import weakref

    from trainer.run import run

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cfg = load(job)
    groups: list[weakref.ref] = []
    init = dist.init_process_group

    def watched(*args, **kwargs):  # every group of the run, weakly
        init(*args, **kwargs)
        groups.append(weakref.ref(dist.group.WORLD))

    new_group = dist.new_group

    def watched_group(*args, **kwargs):
        group = new_group(*args, **kwargs)
        if group is not None:
            groups.append(weakref.ref(group))
        return group

    dist.init_process_group, dist.new_group = watched, watched_group
    code = run(cfg, stop_at=2, resume=False, printer=_Quiet())
    alive = sum(ref() is not None for ref in groups)
    torch.save({"code": code, "groups": len(groups), "alive": alive,
                "resources": _resources()}, f"{out}.{rank}")


def test_the_torchrun_entry_frees_its_world_before_it_returns(token_file: Path, tmp_path: Path):
    job = tmp_path / "job.toml"
    job.write_text(small_job_text(token_file))
    out = tmp_path / "out.pt"
    mp.start_processes(_torchrun_rank, args=(str(job), free_port(), str(out)), nprocs=2,
                       start_method=forkserver())
    for rank in range(2):
        result = torch.load(f"{out}.{rank}", weights_only=False)
        assert result["code"] == 0
        assert result["groups"] > 1  # the world and the mesh's groups were made ...
        assert result["alive"] == 0, result  # ... and none outlives the run
        assert result["resources"][2] == 0, result  # no socket of theirs either
