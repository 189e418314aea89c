"""Process-group set-up and helpers shared by the spawned distributed tests (gloo on CPU)."""
import datetime
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def _log_path(store: str, rank: int) -> str:
    return f"{store}.rank{rank}.log"


def _finished_path(store: str, rank: int) -> str:
    return f"{store}.rank{rank}.finished"


def start(rank: int, world: int, store: str) -> None:
    """Join a gloo group through a file store (no free-port race between process groups) with a
    timeout, so a rank that fails alone ends the run instead of hanging it. The rank's stderr
    (C++ aborts included) goes to a log beside the store, which `spawn` quotes on failure."""
    log = os.open(_log_path(store, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 2)
    os.close(log)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


def stop(store: str) -> None:
    """Leave the group together: tearing gloo down while a peer still talks to it can abort
    the process ("terminate called without an active exception"). Once every rank reached the
    barrier (all its work done) this rank is marked finished beside `store`, so that `spawn`
    can tell a crash in gloo's teardown from one in the work."""
    try:
        dist.barrier()
        Path(_finished_path(store, dist.get_rank())).touch()
    finally:
        dist.destroy_process_group()


def spawn(worker, args: tuple, world: int, store: str) -> None:
    """mp.spawn(worker, args, nprocs=world) for workers that start(..., store) and stop(store).
    A rank killed by a signal after every rank marked itself finished died in process-group
    teardown, past all the work the tests read: warned, not raised. Any other failure is raised
    with the tail of every rank's stderr log (the abort message that mp.spawn does not show)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

    try:
        mp.spawn(worker, args=args, nprocs=world)
    except ProcessException as error:
        logs = "\n".join(f"--- rank {rank} stderr (last lines):\n{_tail(_log_path(store, rank))}"
                         for rank in range(world))
        finished = all(os.path.exists(_finished_path(store, rank)) for rank in range(world))
        if finished and isinstance(error, ProcessExitedException) and error.signal_name:
            warnings.warn(f"{error} in process-group teardown, after every rank finished\n{logs}")
            return
        raise RuntimeError(f"{error}\n{logs}") from error


def _tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_and_report(rank: int, world: int, out_path: str, scenarios) -> None:
    """The body of a spawned worker: join the group, run `scenarios()` on every rank, write rank
    0's results to out_path as JSON, leave the group together."""
    store = f"{out_path}.store"
    start(rank, world, store)
    try:
        results = scenarios()
        if rank == 0:
            with open(out_path, "w") as handle:
                json.dump(results, handle, indent=1)
    finally:
        stop(store)


def spawn_and_read(worker, world: int, out_path, *args) -> dict:
    """Spawn `world` processes of worker(rank, world, out_path, *args) (a run_and_report body)
    and return the JSON rank 0 wrote to out_path."""
    spawn(worker, (world, str(out_path), *args), world, f"{out_path}.store")
    return json.loads(Path(out_path).read_text())


def spawn_per_world(worker, layouts_by_world: dict, folder_of) -> dict:
    """spawn_and_read once per world size with that world's layouts, every result in one dict;
    folder_of(world) gives a fresh folder for each run's files."""
    results = {}
    for world, layouts in layouts_by_world.items():
        results.update(spawn_and_read(worker, world, folder_of(world) / "results.json", layouts))
    return results


def train_in_lockstep(pairs, steps: int, seed: int, batch_shape: tuple[int, int]) -> None:
    """Train each (model, optimizer) pair on the same seeded batches, loss = mean square of the
    output: a distributed model and its one-process reference take identical steps."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randn(*batch_shape, generator=gen)
        for net, optimizer in pairs:
            net(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()


def value_errors(cases: dict) -> dict:
    """Run each case; its ValueError's message, or None when it raised nothing."""
    messages = {}
    for name, build in cases.items():
        try:
            build()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages
