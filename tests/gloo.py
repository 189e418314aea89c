"""Process-group set-up and helpers shared by the spawned distributed tests (gloo on CPU)."""
import datetime
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
# Its functions take group.WORLD as a default argument, read when the module is imported: imported
# inside a live group (DTensor's first tensor imports it), it would hold that group past stop().
import torch.distributed.nn.functional  # noqa: F401


def _log_path(store: str, rank: int) -> str:
    return f"{store}.rank{rank}.log"


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


def stop() -> None:
    """Leave the group together (tearing gloo down while a peer still talks to it can abort the
    process), and let destroy_process_group free every group (_leaving_no_group says why): a
    mesh holds its groups, DTensor's caches hold each mesh they saw, and a flattened mesh and
    its root refer to each other. The caches are emptied and the cycles collected before the
    groups are destroyed: done after, the meshes of the (dp, tp) layouts worker stayed alive.
    A mesh that something still holds then lets go of its groups (_drop_mesh_groups)."""
    try:
        dist.barrier()
    finally:
        _clear_dtensor_caches()
        gc.collect()
        _drop_mesh_groups()
        dist.destroy_process_group()


def _leaving_no_group(rank: int, worker, args: tuple) -> None:
    """worker(rank, *args), then check that no process group outlives it. A group freed while
    the interpreter runs joins its gloo worker threads; a group still held is freed only in
    interpreter shutdown, where a worker thread that was late to free a finished collective's
    tensor takes the GIL, is ended by Python, and aborts the process ("terminate called without
    an active exception", after every rank finished)."""
    worker(rank, *args)
    gc.collect()  # the worker's reference cycles (a flattened mesh and its root) go now, not in shutdown
    left = _gloo_worker_threads()
    if left:
        raise RuntimeError(f"{left} gloo worker threads outlive the worker: something still holds their process "
                           "groups, which interpreter shutdown would then tear down")


def _clear_dtensor_caches() -> None:
    """Empty DTensor's process-wide caches of sharding decisions and redistribution plans (each
    keeps the DeviceMeshes of the specs it saw); a torch without one of them has nothing to clear."""
    try:
        from torch.distributed.tensor import DTensor, _collective_utils, _redistribute
    except ImportError:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    caches = [getattr(propagator, "propagate_op_sharding", None),
              getattr(propagator, "_propagate_tensor_meta_cached", None),
              getattr(_redistribute, "_gen_transform_infos", None),
              getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)]
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    for clear in (getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)):
        if clear is not None:
            clear()


def _drop_mesh_groups() -> None:
    """Empty the process-group table (_pg_registry) of every DeviceMesh still alive, so that
    destroy_process_group frees the groups. torch 2.11 (2.10 too, pytorch/pytorch#181761) keeps
    every mesh a DTensor op saw: building an OpSchema leaks a reference to a tuple of its
    arguments (in the C++ comparison key), which holds their DTensorSpecs and so their meshes,
    beyond the reach of gc and of any cache to clear. No mesh is usable once its groups are gone."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return
    for obj in gc.get_objects():
        # by type: isinstance would ask proxies for their __class__
        if issubclass(type(obj), DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


def _gloo_worker_threads() -> int:
    """How many threads of this process run a gloo group's work queue (torch names them)."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_text().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return count


def spawn(worker, args: tuple, world: int, store: str) -> None:
    """mp.spawn(worker, args, nprocs=world) for workers that start(..., store) and stop(). Any
    rank that fails, in its work, in leaving the group or by leaving a group alive
    (_leaving_no_group), raises with the tail of every rank's stderr log (the abort message that
    mp.spawn does not show)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    try:
        mp.spawn(_leaving_no_group, args=(worker, args), nprocs=world)
    except ProcessException as error:
        logs = "\n".join(f"--- rank {rank} stderr (last lines):\n{_tail(_log_path(store, rank))}"
                         for rank in range(world))
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
        stop()


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
