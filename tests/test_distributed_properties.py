"""Property tests (hypothesis) of the distributed step over world sizes 2 and 4 (gloo, CPU).

One process group per world size is spawned once for the module; its ranks run every property
of tests/distributed_properties_worker.py with the same derandomized examples: Dion3 (local
and global selection; global with unselected_decay), Muon (± Nesterov) and NorMuon on FSDP2 fully_shard (row-sharded, uneven
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

import pytest

import distributed_properties_worker as worker
import gloo

PER_PAIR = 2  # examples per layout × algorithm pair (sharded Dion3 pairs get a multiple)
EXAMPLES = {  # per world size; each example runs a few optimizer steps on several ranks
    "steps_follow_the_rules": worker.rule_examples(PER_PAIR),
    "local_equals_global_at_fraction_one": 6,
    "dion3_sends_less_than_muon": 10,
}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def reports(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"props{world}") / "report"
    counts = dict(EXAMPLES, steps_follow_the_rules=PER_PAIR)
    gloo.spawn(worker.worker, (world, str(out), counts), world, f"{out}.store")
    return [json.loads(out.with_name(f"report.rank{r}.json").read_text()) for r in range(world)]


def _passed(reports: list[dict], name: str) -> dict:
    """The property's coverage counts, once every rank passed it on the same examples."""
    failures = [f"rank {rank}:\n{report[name]['failure'][-3000:]}" for rank, report in enumerate(reports)
                if report[name]["failure"] is not None]
    assert not failures, "\n".join(failures)  # a rank that crashed alone shows next to the ones it left waiting
    result = reports[0][name]
    assert all(report[name] == result for report in reports), "ranks disagree on the examples"
    assert result["examples"] >= EXAMPLES[name], result  # hypothesis really ran them all
    return result["seen"]


def test_steps_follow_the_rules(reports):
    seen = _passed(reports, "steps_follow_the_rules")
    # the examples covered what the property is about, so a degenerate draw cannot pass quietly
    for case in ("layout=fsdp", "layout=ddp", "algorithm=dion3_global", "algorithm=dion3_local",
                 "algorithm=dion3_global_decay",
                 "zero-row rank", "uneven shards", "bucket of several", "sharded-local"):
        assert seen.get(case, 0) > 0, (case, seen)
    assert sum(v for k, v in seen.items() if k.startswith("algorithm=")) == seen["exact"] + seen["sharded-local"]


def test_local_equals_global_at_fraction_one(reports):
    _passed(reports, "local_equals_global_at_fraction_one")


def test_dion3_sends_less_than_muon(reports):
    seen = _passed(reports, "dion3_sends_less_than_muon")
    for layout in ("fsdp", "ddp"):
        assert seen.get(f"{layout}/strictly below", 0) >= 2, seen
