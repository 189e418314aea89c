"""Process-group set-up and helpers shared by the spawned distributed tests (gloo on CPU)."""
import datetime
import json

import torch
import torch.distributed as dist


def start(rank: int, world: int, store: str) -> None:
    """Join a gloo group through a file store (no free-port race between process groups) with a
    timeout, so a rank that fails alone ends the run instead of hanging it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


def stop() -> None:
    """Leave the group together: tearing gloo down while a peer still talks to it can abort
    the process ("terminate called without an active exception")."""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_and_report(rank: int, world: int, out_path: str, scenarios) -> None:
    """The body of a spawned worker: join the group, run `scenarios()` on every rank, write rank
    0's results to out_path as JSON, leave the group together."""
    start(rank, world, f"{out_path}.store")
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
    import torch.multiprocessing as mp
    from pathlib import Path

    mp.spawn(worker, args=(world, str(out_path), *args), nprocs=world)
    return json.loads(Path(out_path).read_text())


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
