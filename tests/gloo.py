"""Process-group set-up shared by the spawned distributed tests (gloo on CPU)."""
import datetime

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
