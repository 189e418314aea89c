"""The spawned-test harness (tests/gloo.py) on workers that crash on purpose: a rank aborted in
its work fails the run with that rank's own stderr; a rank aborted in teardown, after every rank
finished, leaves the results readable (a warning); a clean run warns of nothing."""
import json
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import gloo


def crashing_worker(rank: int, world: int, out_path: str, when: str) -> None:
    store = f"{out_path}.store"
    gloo.start(rank, world, store)

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    total = float(value)
    if when == "work" and rank == 1:
        print("rank 1 gives up in its work", file=sys.stderr, flush=True)
        os.abort()
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"sum": total}, handle)
    gloo.stop(store)
    if when == "teardown" and rank == 1:
        os.abort()


def _run(tmp_path, when: str) -> dict:
    out = tmp_path / "results.json"
    gloo.spawn(crashing_worker, (2, str(out), when), 2, f"{out}.store")
    return json.loads(out.read_text())


def test_clean_run_returns_results_without_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _run(tmp_path, "never") == {"sum": 3.0}


def test_abort_after_every_rank_finished_warns_and_keeps_results(tmp_path):
    with pytest.warns(UserWarning, match="SIGABRT in process-group teardown"):
        assert _run(tmp_path, "teardown") == {"sum": 3.0}


def test_abort_in_the_work_fails_quoting_the_rank_stderr(tmp_path):
    with pytest.raises(RuntimeError, match="SIGABRT") as raised:
        _run(tmp_path, "work")
    assert "--- rank 1 stderr" in str(raised.value)
    assert "rank 1 gives up in its work" in str(raised.value)
