"""The spawned-test harness (tests/gloo.py) on workers that crash or leak on purpose: a rank
aborted in its work, or after leaving the group, fails the run with that rank's own stderr; a
process group the worker leaves alive fails the run (interpreter shutdown would tear it down,
where a late gloo worker thread aborts the process), while a mesh kept alive lets go of its
groups; DTensor's caches, which hold every mesh they saw, keep none once the worker returned; a
clean run warns of nothing."""
import json
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import gloo

KEPT = []  # what a worker keeps for the life of its process


def crashing_worker(rank: int, world: int, out_path: str, when: str) -> None:
    store = f"{out_path}.store"
    gloo.start(rank, world, store)

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    total = float(value)
    if when == "work" and rank == 1:
        print("rank 1 gives up in its work", file=sys.stderr, flush=True)
        os.abort()
    if when == "keep_group":
        KEPT.append(dist.new_group([0, 1]))
    if when == "keep_mesh":  # as torch 2.10–2.11's leak of OpSchema arguments keeps every mesh
        from torch.distributed.device_mesh import init_device_mesh

        KEPT.append(init_device_mesh("cpu", (world,)))
    if when == "dtensor":
        total = _redistributed_sum(rank, world)
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"sum": total}, handle)
    gloo.stop()
    if when == "teardown" and rank == 1:
        print("rank 1 gives up after leaving the group", file=sys.stderr, flush=True)
        os.abort()


def _redistributed_sum(rank: int, world: int) -> float:
    """A redistribution on a mesh of its own: afterwards only DTensor's caches hold the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    whole = torch.full((4, 2), float(rank + 1))
    return float(distribute_tensor(whole, mesh, [Shard(0)], src_data_rank=None).full_tensor().sum())


def _run(tmp_path, when: str) -> dict:
    out = tmp_path / "results.json"
    gloo.spawn(crashing_worker, (2, str(out), when), 2, f"{out}.store")
    return json.loads(out.read_text())


def test_clean_run_returns_results_without_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _run(tmp_path, "never") == {"sum": 3.0}


def test_abort_in_the_work_fails_quoting_the_rank_stderr(tmp_path):
    with pytest.raises(RuntimeError, match="SIGABRT") as raised:
        _run(tmp_path, "work")
    assert "--- rank 1 stderr" in str(raised.value)
    assert "rank 1 gives up in its work" in str(raised.value)


def test_abort_after_leaving_the_group_fails_the_run(tmp_path):
    """Results complete on disk do not excuse a rank that died: a real job logs it as a crash."""
    with pytest.raises(RuntimeError, match="SIGABRT") as raised:
        _run(tmp_path, "teardown")
    assert "rank 1 gives up after leaving the group" in str(raised.value)


def test_a_group_kept_past_the_worker_fails_the_run(tmp_path):
    with pytest.raises(RuntimeError, match="gloo worker threads outlive the worker"):
        _run(tmp_path, "keep_group")


def test_a_mesh_kept_past_the_worker_lets_go_of_its_groups(tmp_path):
    """stop() empties the group table of every mesh still alive: destroy_process_group frees
    the groups, and no gloo worker thread is left for interpreter shutdown."""
    assert _run(tmp_path, "keep_mesh") == {"sum": 3.0}


def test_dtensor_caches_keep_no_mesh_past_the_worker(tmp_path):
    """Each rank keeps its own half of its own 4 × 2 tensor (src_data_rank=None): two rows of
    ones from rank 0, two rows of twos from rank 1, so the full tensor sums to 4·1 + 4·2 = 12;
    and no gloo worker thread is left once the worker returned."""
    assert _run(tmp_path, "dtensor") == {"sum": 12.0}
