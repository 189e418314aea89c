"""Property tests (hypothesis) of the distributed step over world sizes 2 and 4 (gloo, CPU).

One process group per world size is spawned once for the module; its ranks run every property
of tests/distributed_properties_worker.py with the same derandomized examples: Dion3 (local
and global selection), Muon (± Nesterov) and NorMuon on FSDP2 fully_shard (row-sharded, uneven
shards, ranks holding no rows) and DDP (replicated), 1–40 rows. Checked per step:
  - finite weights and state;
  - only the selected rows (those whose momentum got error feedback) move beyond weight decay,
    exactly k = max(1, ⌈f·rows⌉) per matrix for global scope (and DDP), and on each rank
    min(⌈f·⌈rows/W⌉⌉, its rows) of its own top rows for local scope; Muon/NorMuon move all rows;
  - the result equals a single-process run of the same optimizer (float32 Newton–Schulz,
    relative error ≤ 1e-5) wherever the rule is layout-independent (all but sharded local f < 1);
  - every rank's `communication_bytes` equals a hand count from the selected rows;
  - local scope at f = 1 equals global scope;
  - Dion3 (f ≤ ½) never sends more row payload than Muon on the same shapes, and strictly fewer
    bytes in total where that is guaranteed (see dion3_sends_less_than_muon).
"""
from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp

import distributed_properties_worker as worker

PER_PAIR = 2  # examples per layout × algorithm pair (sharded Dion3 pairs get a multiple)
EXAMPLES = {  # per world size; each example runs a few optimizer steps on several ranks
    "steps_follow_the_rules": worker.rule_examples(PER_PAIR),
    "local_equals_global_at_fraction_one": 6,
    "dion3_sends_less_than_muon": 10,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def report(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"props{world}") / "report"
    counts = dict(EXAMPLES, steps_follow_the_rules=PER_PAIR)
    mp.spawn(worker.worker, args=(world, _free_port(), str(out), counts), nprocs=world)
    reports = [json.loads(out.with_name(f"report.rank{r}.json").read_text()) for r in range(world)]
    assert all(r == reports[0] for r in reports), "ranks disagree on the outcome"
    return {"world": world, **reports[0]}


def _passed(report, name: str) -> dict:
    result = report[name]
    assert result["failure"] is None, result["failure"]
    assert result["examples"] >= EXAMPLES[name], result  # hypothesis really ran them all
    return result["seen"]


def test_steps_follow_the_rules(report):
    seen = _passed(report, "steps_follow_the_rules")
    # the examples covered what the property is about, so a degenerate draw cannot pass quietly
    for case in ("layout=fsdp", "layout=ddp", "algorithm=dion3_global", "algorithm=dion3_local",
                 "zero-row rank", "uneven shards", "bucket of several", "sharded-local"):
        assert seen.get(case, 0) > 0, (case, seen)
    assert sum(v for k, v in seen.items() if k.startswith("algorithm=")) == seen["exact"] + seen["sharded-local"]


def test_local_equals_global_at_fraction_one(report):
    _passed(report, "local_equals_global_at_fraction_one")


def test_dion3_sends_less_than_muon(report):
    seen = _passed(report, "dion3_sends_less_than_muon")
    assert seen.get("strictly below", 0) >= 3, seen
    assert seen.get("regime=large", 0) > 0 and seen.get("layout=fsdp", 0) > 0, seen
