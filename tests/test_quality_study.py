"""src/dion3/tools/study.py: the run plan, the summary's statistics (by hand), and the CPU
smoke mode end to end: runs in separate processes, one JSON line each, a rerun skips them."""
from __future__ import annotations

import hashlib
import json
import math
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def study():
    from dion3.tools import study as module

    return module


def test_plan_covers_the_grid_short_horizons_first(study):
    args = study.parse_args(["--horizons", "400,100", "--seeds", "0,1", "--optimizers", "normuon,dion3", "--normuon-mu", "0.6,0.8",
                             "--dion3-lr", "0.04", "--dion3-mu", "0.3", "--fraction-warmup", "0,50,25%"])
    runs = study.plan_runs(args)
    # per horizon and seed: 2 NorMuon (μ) + 1 Dion3 lr/μ × 3 warm-ups (0, 50, 25% of the horizon)
    assert len(runs) == 2 * 2 * (2 + 3)
    assert [r.horizon for r in runs] == [100] * 10 + [400] * 10
    assert sorted({r.fraction_warmup for r in runs if r.horizon == 400}) == [0, 50, 100]
    assert sorted({r.fraction_warmup for r in runs if r.horizon == 100}) == [0, 25, 50]
    assert len({r.key for r in runs}) == len(runs)
    assert all(r.fraction is None and r.fraction_warmup == 0 for r in runs if r.optimizer == "normuon")
    with pytest.raises(SystemExit, match="--fraction-warmup"):
        study.plan_runs(study.parse_args(["--fraction-warmup", "ten"]))
    with pytest.raises(SystemExit, match="unknown 'sgd'"):
        study.plan_runs(study.parse_args(["--optimizers", "sgd"]))
    # the baselines: AdamW has no μ grid; Muon's lr × μ; --repeats runs each again
    every = study.plan_runs(study.parse_args(["--horizons", "100", "--seeds", "0", "--adamw-lr", "0.001,0.003",
                                              "--muon-lr", "0.02", "--muon-mu", "0.9,0.95", "--repeats", "2"]))
    assert sum(r.optimizer == "adamw" for r in every) == 2 * 2 and sum(r.optimizer == "muon" for r in every) == 2 * 2
    assert all(r.read_once for r in every) and len({r.key for r in every}) == len(every)


@pytest.mark.parametrize("argv, message", [
    (["--dion3-lr", "0.02,-1"], "--dion3-lr values must lie in (0, inf), got '0.02,-1'"),
    (["--muon-lr", "0"], "--muon-lr values must lie in (0, inf)"),
    (["--adamw-lr", "inf"], "--adamw-lr values must lie in (0, inf)"),
    (["--dion3-mu", "1.0"], "--dion3-mu values must lie in [0, 1), got '1.0'"),
    (["--normuon-mu", "-0.1"], "--normuon-mu values must lie in [0, 1)"),
    (["--fraction-warmup", "0,-5"], "--fraction-warmup must not be negative, got '-5'"),
    (["--batch-size", "0"], "--batch-size must be ≥ 1, got 0"),
    (["--lr-warmup", "-1"], "--lr-warmup must be ≥ 0 steps, got -1"),
    (["--cooldown", "1.5"], "--cooldown is a share of the steps in [0, 1], got 1.5"),
])
def test_a_setting_no_run_could_train_with_is_refused_before_any_run(study, argv, message):
    with pytest.raises(SystemExit) as refused:
        study.plan_runs(study.parse_args(["--horizons", "100", "--seeds", "0"] + argv))
    assert message in str(refused.value)


def test_the_edges_of_each_range_are_accepted(study):
    runs = study.plan_runs(study.parse_args([
        "--horizons", "100", "--seeds", "0", "--optimizers", "muon,dion3", "--muon-mu", "0", "--dion3-mu", "0.99",
        "--fraction-warmup", "0", "--lr-warmup", "0", "--cooldown", "1", "--batch-size", "1"]))
    assert {(r.optimizer, r.mu) for r in runs} == {("muon", 0.0), ("dion3", 0.99)}
    assert all(r.cooldown == 1.0 and r.lr_warmup == 0 and r.batch_size == 1 for r in runs)


def test_cost_allocation_runs_beside_uniform_ones_and_warms_its_budget_up(study):
    args = ["--horizons", "100", "--seeds", "0", "--optimizers", "dion3", "--dion3-lr", "0.04", "--dion3-mu", "0.3"]
    runs = study.plan_runs(study.parse_args(args + ["--fraction-warmup", "0", "--fraction-allocation", "uniform,cost"]))
    assert [(r.fraction_allocation, r.label) for r in runs] == [
        ("uniform", "dion3-1/4 lr=0.04 mu=0.3 h=100 seed=0"), ("cost", "dion3-1/4-cost lr=0.04 mu=0.3 h=100 seed=0")]
    assert runs[0].setting != runs[1].setting and runs[0].key != runs[1].key
    # a uniform eager float32 run's key is the hash of its settings without the allocation, compile
    # and momentum-dtype fields, as before those fields existed
    fields = {k: v for k, v in json.loads(json.dumps(runs[0].__dict__)).items()
              if k not in ("fraction_allocation", "compiled", "momentum_dtype", "cost_rule", "row_score", "fraction_weights",
                           "ns_coefficients", "unselected_decay", "full_every")}
    assert runs[0].key == hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    # fractions by cost spend modeled time now; a record of the earlier FLOP rule (config without
    # cost_rule) keeps its key and reads back as another setting, labelled as such
    assert runs[1].cost_rule == "time"
    earlier = {k: v for k, v in json.loads(json.dumps(runs[1].__dict__)).items()
               if k not in ("cost_rule", "row_score", "fraction_weights", "ns_coefficients", "unselected_decay", "full_every")}
    old = study.Run(**earlier)
    assert old.label == "dion3-1/4-cost-flops lr=0.04 mu=0.3 h=100 seed=0"
    assert old.key == hashlib.sha1(json.dumps({k: v for k, v in earlier.items() if k not in ("compiled", "momentum_dtype")},
                                              sort_keys=True).encode()).hexdigest()[:16]
    assert old.key != runs[1].key and old.setting != runs[1].setting
    # a warm-up of the budget by cost: its own setting, key and label beside the fixed one
    warm = study.plan_runs(study.parse_args(args + ["--fraction-warmup", "0,50", "--fraction-allocation", "cost"]))
    assert [(r.fraction_warmup, r.label) for r in warm] == [
        (0, "dion3-1/4-cost lr=0.04 mu=0.3 h=100 seed=0"), (50, "dion3-1/4-cost-warmup50 lr=0.04 mu=0.3 h=100 seed=0")]
    assert warm[0].key == runs[1].key and warm[1].key != warm[0].key and warm[1].setting != warm[0].setting
    with pytest.raises(SystemExit, match="--fraction-allocation"):
        study.plan_runs(study.parse_args(args + ["--fraction-allocation", "cheap"]))


def test_fraction_grid_plans_each_fraction_and_keeps_the_single_fraction_keys(study):
    args = ["--horizons", "100", "--seeds", "0", "--optimizers", "dion3", "--dion3-lr", "0.03", "--dion3-mu", "0.6",
            "--fraction-warmup", "0"]
    single, = study.plan_runs(study.parse_args(args))
    grid = study.plan_runs(study.parse_args(args + ["--fraction", "0.25,0.125", "--fraction-allocation", "uniform,cost"]))
    assert [(r.fraction, r.fraction_allocation) for r in grid] == [
        (0.25, "uniform"), (0.25, "cost"), (0.125, "uniform"), (0.125, "cost")]
    assert single.fraction == 0.25 and grid[0].key == single.key and len({r.key for r in grid}) == 4
    for bad in ("0", "0.25,1.5", "a"):
        with pytest.raises(SystemExit, match="--fraction"):
            study.plan_runs(study.parse_args(args + ["--fraction", bad]))


def test_compiled_runs_are_their_own_settings_and_old_keys_stay_valid(study):
    args = ["--horizons", "100", "--seeds", "0", "--optimizers", "normuon", "--normuon-mu", "0.6"]
    eager, = study.plan_runs(study.parse_args(args))
    compiled, = study.plan_runs(study.parse_args(args + ["--compile"]))
    assert compiled.compiled and not eager.compiled
    assert compiled.setting != eager.setting and compiled.key != eager.key and compiled.label == eager.label
    # a record written before the field existed (quality-study-llama-384, 2026-12-02) keeps its key
    config = {"model": "llama-384", "optimizer": "dion3", "lr": 0.06, "mu": 0.6, "fraction": 0.25, "fraction_warmup": 200,
              "horizon": 1500, "seed": 0, "batch_size": 32, "lr_warmup": 50, "cooldown": 0.3, "eval_batches": 16,
              "data": None, "read_once": True, "repeat": 0, "captured": False}
    assert study.Run(**config).key == "c02a86927e070607"
    rows = study.summary_table([{**_record(study, "normuon", 1.5, 0), "config": json.loads(json.dumps(compiled.__dict__))},
                                {**_record(study, "normuon", 1.6, 0), "config": json.loads(json.dumps(eager.__dict__))}])
    assert "| gpt-25m (compiled) | 100 | NorMuon |" in rows and "| gpt-25m | 100 | NorMuon |" in rows


def test_momentum_dtypes_are_their_own_settings_and_float32_keeps_the_old_keys(study):
    args = ["--horizons", "100", "--seeds", "0", "--optimizers", "adamw,muon", "--muon-mu", "0.8"]
    plain = study.plan_runs(study.parse_args(args))
    both = study.plan_runs(study.parse_args(args + ["--momentum-dtype", "float32,bfloat16"]))
    # AdamW has no matrix momentum: it runs once; Muon once per dtype, float32 with the key of before
    assert [(r.optimizer, r.momentum_dtype) for r in both] == [("adamw", None), ("muon", None), ("muon", "bfloat16")]
    assert [r.key for r in both[:2]] == [r.key for r in plain]
    assert both[2].key != both[1].key and both[2].setting != both[1].setting
    assert "momentum-bfloat16" in both[2].label
    rows = study.summary_table([{**_record(study, "muon", 1.5, 0), "config": json.loads(json.dumps(both[2].__dict__))}])
    assert "| Muon, bfloat16 momentum |" in rows
    with pytest.raises(SystemExit, match="--momentum-dtype expects some of"):
        study.plan_runs(study.parse_args(args + ["--momentum-dtype", "float16"]))
    # the best setting is judged in float32, then run in each dtype asked for
    best = study.Run("llama-384", "muon", 0.01, 0.8, None, 0, 1500, 0, 32, 50, 0.3, 16, None, compiled=True)
    other = study.Run("llama-384", "muon", 0.02, 0.8, None, 0, 1500, 0, 32, 50, 0.3, 16, None, compiled=True,
                      momentum_dtype="bfloat16")
    records = [{"config": json.loads(json.dumps(best.__dict__)), "final_val_loss": 1.0},
               {"config": json.loads(json.dumps(other.__dict__)), "final_val_loss": 0.5}]
    rerun = study.plan_best_runs(study.parse_args(["--model", "llama-384", "--optimizers", "muon", "--compile", "--horizons", "1500", "--seeds", "1",
                                                   "--momentum-dtype", "bfloat16"]), records)
    assert [(r.lr, r.seed, r.momentum_dtype) for r in rerun] == [(0.01, 1, "bfloat16")]


def test_best_of_each_family_is_judged_on_shared_seeds_and_rerun_with_its_own_fields(study):
    def record(optimizer, lr, seed, loss, allocation="uniform", compiled=True, fraction=None, horizon=1500,
               cost_rule="time"):
        run = study.Run("llama-384", optimizer, lr, 0.6, fraction, 0, horizon, seed, 32, 50, 0.3, 16, None,
                        fraction_allocation=allocation, compiled=compiled,
                        cost_rule=cost_rule if allocation == "cost" else None)
        return {"config": json.loads(json.dumps(run.__dict__)), "final_val_loss": loss}

    records = [
        # NorMuon: lr 0.02 ran seeds 1 and 2 as well and has the lower mean over all its seeds, but on
        # the one seed both settings share (0) lr 0.01 is better
        record("normuon", 0.01, 0, 1.00), record("normuon", 0.02, 0, 1.10),
        record("normuon", 0.02, 1, 0.50), record("normuon", 0.02, 2, 0.50),
        # Dion3: one best per allocation; a non-finite run never counts
        record("dion3", 0.03, 0, 1.20, fraction=0.25), record("dion3", 0.06, 0, float("nan"), fraction=0.25),
        record("dion3", 0.03, 0, 1.30, "cost", fraction=0.25), record("dion3", 0.06, 0, 1.25, "cost", fraction=0.25),
        # another horizon, an eager run, and a run by cost of the FLOP rule (no cost_rule: rerun now,
        # it would allocate by modeled time) are not candidates
        record("normuon", 0.04, 0, 0.10, horizon=400), record("normuon", 0.08, 0, 0.10, compiled=False),
        record("dion3", 0.12, 0, 0.10, "cost", fraction=0.25, cost_rule=None),
    ]
    args = study.parse_args(["--model", "llama-384", "--optimizers", "normuon,dion3", "--fraction-warmup", "0",
                             "--fraction-allocation", "uniform,cost", "--horizons", "6000", "--seeds", "0,1", "--compile"])
    runs = study.plan_best_runs(args, records)
    assert [(r.optimizer, r.lr, r.fraction_allocation, r.horizon, r.seed) for r in runs] == [
        ("normuon", 0.01, "uniform", 6000, 0), ("dion3", 0.03, "uniform", 6000, 0), ("dion3", 0.06, "cost", 6000, 0),
        ("normuon", 0.01, "uniform", 6000, 1), ("dion3", 0.03, "uniform", 6000, 1), ("dion3", 0.06, "cost", 6000, 1)]
    assert all(r.compiled and r.batch_size == 32 and r.lr_warmup == 50 and r.cooldown == 0.3 for r in runs)
    assert {r.cost_rule for r in runs if r.fraction_allocation == "cost"} == {study.runs.COST_RULE}
    # without --compile only eager runs are candidates: the eager NorMuon alone
    eager = study.parse_args(["--model", "llama-384", "--optimizers", "normuon", "--horizons", "1500", "--seeds", "1"])
    assert [(r.lr, r.compiled) for r in study.plan_best_runs(eager, records)] == [(0.08, False)]
    with pytest.raises(SystemExit, match="no finite llama-384 run at horizon 1500"):
        study.plan_best_runs(study.parse_args(["--model", "llama-384", "--optimizers", "muon"]), records)


def _record(study, optimizer, loss, seed, fraction=None, warmup=0, average=1.0, ms=2.0, train=None, allocation="uniform",
            tflop=None):
    run = study.Run("gpt-tiny", optimizer, 0.02, 0.6, fraction, warmup, 400, seed, 16, 20, 0.4, 4, None,
                    fraction_allocation=allocation)
    record = {"key": run.key, "config": json.loads(json.dumps(run.__dict__)), "seed": seed, "horizon": 400,
              "final_val_loss": loss, "average_fraction": average, "optimizer_ms_median": ms}
    if train is not None:
        record["final_train_loss"] = train
    if tflop is not None:
        record["optimizer_tflop"] = tflop
    return record


def test_l2_row_scores_are_their_own_dion3_settings_and_l1_keeps_the_recorded_keys(study):
    args = ["--horizons", "100", "--seeds", "0", "--optimizers", "muon,dion3", "--muon-mu", "0.8", "--fraction", "0.5",
            "--dion3-lr", "0.015", "--dion3-mu", "0.6", "--fraction-warmup", "0", "--fraction-allocation", "cost"]
    plain = study.plan_runs(study.parse_args(args))
    both = study.plan_runs(study.parse_args(args + ["--row-score", "l1,l2"]))
    # Muon has no selection: it runs once; Dion3 once per score, l1 with the key of before
    assert [(r.optimizer, r.row_score) for r in both] == [("muon", "l1"), ("dion3", "l1"), ("dion3", "l2")]
    assert [r.key for r in both[:2]] == [r.key for r in plain]
    assert both[2].key != both[1].key and both[2].setting != both[1].setting and both[2].label.startswith("dion3-1/2-cost-l2 ")
    rows = study.summary_table([{**_record(study, "dion3", 1.5, 0, 0.5), "config": json.loads(json.dumps(both[2].__dict__))}])
    assert "| Dion3, rows by L2 | 1/2 by cost |" in rows
    with pytest.raises(SystemExit, match="--row-score expects some of"):
        study.plan_runs(study.parse_args(args + ["--row-score", "l3"]))
    # a run recorded before the option (no row_score in its config) keeps its key
    recorded = Path(__file__).parent.parent / "benchmarks/results/frontier/results.jsonl"
    record = next(r for r in map(json.loads, recorded.read_text().splitlines()) if "row_score" not in r["config"])
    assert "row_score" not in record["config"] and study.Run(**{**record["config"], "data": None}).key == record["key"]


def test_rule_variants_are_their_own_dion3_settings_and_the_rule_keeps_the_recorded_keys(study):
    """--unselected-decay and --full-every: each Dion3 setting once per value (Muon once); the rule's
    runs (1, 0) keep the keys they had before the options; the others are their own settings,
    labelled apart in run names and the summary; values no run could train with are refused."""
    from dion3.tools.train import trainer
    from dion3.tools.train.model import GPTConfig

    args = ["--horizons", "100", "--seeds", "0", "--optimizers", "muon,dion3", "--muon-mu", "0.8", "--fraction", "0.5",
            "--dion3-lr", "0.02", "--dion3-mu", "0.6", "--fraction-warmup", "0", "--fraction-allocation", "cost"]
    plain = study.plan_runs(study.parse_args(args))
    runs = study.plan_runs(study.parse_args(args + ["--unselected-decay", "1,0.9", "--full-every", "0,8"]))
    assert [(r.optimizer, r.unselected_decay, r.full_every) for r in runs] == [
        ("muon", 1.0, 0), ("dion3", 1.0, 0), ("dion3", 1.0, 8), ("dion3", 0.9, 0), ("dion3", 0.9, 8)]
    assert [r.key for r in runs[:2]] == [r.key for r in plain] and len({r.key for r in runs}) == 5
    assert len({r.setting for r in runs}) == 5
    assert [r.label.split(" ")[0] for r in runs[1:]] == [
        "dion3-1/2-cost", "dion3-1/2-cost-full-every8", "dion3-1/2-cost-unselected0.9",
        "dion3-1/2-cost-unselected0.9-full-every8"]
    rows = study.summary_table([{**_record(study, "dion3", 1.5, 0, 0.5), "config": json.loads(json.dumps(r.__dict__))}
                                for r in runs[1:]])
    for name in ("Dion3", "Dion3, all rows every 8 steps", "Dion3, unselected rows ×0.9 a step",
                 "Dion3, unselected rows ×0.9 a step, all rows every 8 steps"):
        assert f"| {name} | 1/2 by cost |" in rows, name
    for flag, bad, message in (("--unselected-decay", "0", "--unselected-decay values must lie in (0, 1], got '0'"),
                               ("--unselected-decay", "0.9,1.5", "--unselected-decay values must lie in (0, 1]"),
                               ("--full-every", "-1", "--full-every expects comma-separated integers ≥ 0"),
                               ("--full-every", "2.5", "--full-every expects comma-separated integers ≥ 0")):
        with pytest.raises(SystemExit) as refused:
            study.plan_runs(study.parse_args(args + [flag, bad]))
        assert message in str(refused.value)
    # every landed record keeps its key, and a run of the rule keys alike with or without the fields
    # (records from before the options have none; later ones hold them at 1 and 0)
    recorded = Path(__file__).parent.parent / "benchmarks/results/frontier/results.jsonl"
    for record in map(json.loads, recorded.read_text().splitlines()):
        config = {**record["config"], "data": None}
        assert study.Run(**config).key == record["key"]
        if config.get("unselected_decay", 1.0) == 1.0 and not config.get("full_every", 0):
            without = {k: v for k, v in config.items() if k not in ("unselected_decay", "full_every")}
            assert study.Run(**without).key == record["key"]
    # the decay reaches every Dion3 group the trainer builds (by cost: one group per shape)
    spec = trainer.RunSpec("d", "dion3", 0.02, 0.5, fraction_allocation="cost", unselected_decay=0.9, full_every=8)
    groups = trainer.build_optimizer(trainer.GPT(GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64)), spec).param_groups
    assert {g["unselected_decay"] for g in groups if g["algorithm"] == "dion3"} == {0.9}


def test_the_best_of_a_rule_variant_is_its_own_and_only_asked_for(study):
    """--best-from judges each rule variant apart, and only those asked for: by default (1, 0) a
    better loss of a variant never stands in for the rule's best (the seed jobs rerun the rule)."""
    def record(lr, loss, decay=1.0, full_every=0):
        run = study.Run("llama-384", "dion3", lr, 0.6, 0.5, 0, 1500, 0, 128, 50, 0.3, 4, None, compiled=True,
                        fraction_allocation="cost", cost_rule="time", unselected_decay=decay, full_every=full_every)
        return {"config": json.loads(json.dumps(run.__dict__)), "final_val_loss": loss}

    records = [record(0.02, 1.0), record(0.03, 1.1), record(0.02, 0.9, decay=0.9), record(0.03, 0.8, full_every=8)]
    argv = ["--model", "llama-384", "--optimizers", "dion3", "--compile", "--horizons", "3000", "--seeds", "1",
            "--batch-size", "128", "--fraction", "0.5", "--fraction-allocation", "cost", "--fraction-warmup", "0"]
    rule_only = study.plan_best_runs(study.parse_args(argv), records)
    assert [(r.lr, r.unselected_decay, r.full_every) for r in rule_only] == [(0.02, 1.0, 0)]
    every = study.plan_best_runs(study.parse_args(argv + ["--unselected-decay", "1,0.9", "--full-every", "0,8"]), records)
    assert sorted((r.unselected_decay, r.full_every, r.lr) for r in every) == [(0.9, 0, 0.02), (1.0, 0, 0.02),
                                                                               (1.0, 8, 0.03)]


def test_fraction_weights_are_their_own_settings_and_reach_the_allocation(study):
    from dion3.tools.train import trainer
    from dion3.tools.train.model import GPTConfig

    args = ["--horizons", "100", "--seeds", "0", "--optimizers", "dion3", "--fraction", "0.25", "--dion3-lr", "0.02",
            "--dion3-mu", "0.6", "--fraction-warmup", "0", "--fraction-allocation", "cost"]
    plain = study.plan_runs(study.parse_args(args))
    runs = study.plan_runs(study.parse_args(args + ["--fraction-weights", "none", "mlp.=4", "q=2, attn.=3", "attn.=3,q=2"]))
    # one spelling per setting (parts in name order, weights as numbers), unweighted runs keep their keys
    assert [r.fraction_weights for r in runs] == [None, "mlp.=4", "attn.=3,q=2"]
    assert runs[0].key == plain[0].key and len({r.key for r in runs}) == 3
    assert runs[1].label.startswith("dion3-1/4-cost-weights[mlp.=4] ")
    rows = study.summary_table([{**_record(study, "dion3", 1.5, 0, 0.25), "config": json.loads(json.dumps(runs[1].__dict__))}])
    assert "| Dion3, rows weighted mlp.=4 | 1/4 by cost |" in rows
    # the weights reach param_groups: on this model a weight on the MLP moves rows there (at d = 64
    # the cheapest allocation gives every matrix but fc all its rows, weighted or not)
    config = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=128)

    def fractions(weights):
        spec = trainer.RunSpec("d", "dion3", 0.02, 0.25, fraction_allocation="cost",
                               fraction_weights=study.runs.parse_fraction_weights(weights))
        groups = trainer.build_optimizer(trainer.GPT(config), spec).param_groups
        return {tuple(p.shape): g["fraction"] for g in groups if g.get("algorithm", "dion3") == "dion3" for p in g["params"]}

    plain_fractions, weighted = fractions(None), fractions("mlp.=4")
    assert weighted[(512, 128)] > plain_fractions[(512, 128)] and weighted[(128, 128)] < plain_fractions[(128, 128)]
    for bad in ("mlp", "mlp=0", "=2"):
        with pytest.raises(SystemExit, match="--fraction-weights expects part=weight pairs"):
            study.plan_runs(study.parse_args(args + ["--fraction-weights", bad]))
    with pytest.raises(SystemExit, match="use it with --fraction-allocation cost and/or most_rows alone"):
        study.plan_runs(study.parse_args(args[:-1] + ["uniform", "--fraction-weights", "mlp.=2"]))


def test_ns_schedules_are_their_own_settings_and_the_default_keeps_the_recorded_keys(study):
    from dion3.tools.train import trainer
    from dion3.tools.train.model import GPTConfig

    args = ["--horizons", "100", "--seeds", "0", "--optimizers", "adamw,muon,normuon,dion3", "--muon-mu", "0.8",
            "--normuon-mu", "0.6", "--fraction", "0.5", "--dion3-lr", "0.015", "--dion3-mu", "0.6", "--fraction-warmup", "0",
            "--fraction-allocation", "cost"]
    plain = study.plan_runs(study.parse_args(args))
    both = study.plan_runs(study.parse_args(args + ["--ns-coefficients", "polar_express,polar_express_4"]))
    # AdamW orthogonalizes nothing: it runs once; every other setting once per schedule
    assert [(r.optimizer, r.ns_coefficients) for r in both] == [
        ("adamw", "polar_express"), ("muon", "polar_express"), ("muon", "polar_express_4"), ("normuon", "polar_express"),
        ("normuon", "polar_express_4"), ("dion3", "polar_express"), ("dion3", "polar_express_4")]
    default = [r for r in both if r.ns_coefficients == "polar_express"]
    assert [r.key for r in default] == [r.key for r in plain] and [r.label for r in default] == [r.label for r in plain]
    for four, five in zip(both[2::2], both[1::2]):
        assert four.key != five.key and four.setting != five.setting
        assert four.label == five.label.replace(" lr=", "-polar_express_4 lr=", 1)
    assert "ns_coefficients" not in study.Run(**{**json.loads(json.dumps(plain[1].__dict__)), "data": None}).key
    rows = study.summary_table([{**_record(study, r.optimizer, 1.5, 0, r.fraction), "config": json.loads(json.dumps(r.__dict__))}
                                for r in both[1:]])
    assert "| Muon, 4 NS steps | — |" in rows and "| NorMuon, 4 NS steps | — |" in rows
    assert "| Dion3, 4 NS steps | 1/2 by cost |" in rows and "| Muon | — |" in rows and "| Dion3 | 1/2 by cost |" in rows
    with pytest.raises(SystemExit, match="--ns-coefficients expects some of"):
        study.plan_runs(study.parse_args(args + ["--ns-coefficients", "polar_express_6"]))
    # a run recorded before the option (no ns_coefficients in its config) keeps its key
    recorded = Path(__file__).parent.parent / "benchmarks/results/frontier/results.jsonl"
    record = next(map(json.loads, recorded.read_text().splitlines()))
    assert "ns_coefficients" not in record["config"] and study.Run(**{**record["config"], "data": None}).key == record["key"]
    # the schedule reaches every matrix group the trainer builds (Dion3 by cost: one group per shape)
    config = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64)
    for algorithm, fraction, allocation in (("muon", None, "uniform"), ("dion3", 0.5, "cost")):
        spec = trainer.RunSpec("d", algorithm, 0.02, fraction, fraction_allocation=allocation, ns_coefficients="polar_express_4")
        groups = trainer.build_optimizer(trainer.GPT(config), spec).param_groups
        matrix_groups = [g for g in groups if g.get("algorithm", "dion3") == algorithm]
        assert len(matrix_groups) >= 1 and {g["ns_coefficients"] for g in matrix_groups} == {"polar_express_4"}


def test_the_best_setting_is_judged_per_schedule(study):
    def record(optimizer, lr, loss, schedule="polar_express"):
        run = study.Run("llama-384", optimizer, lr, 0.8, None, 0, 1500, 0, 32, 50, 0.3, 16, None, compiled=True,
                        ns_coefficients=schedule)
        return {"config": json.loads(json.dumps(run.__dict__)), "final_val_loss": loss}

    records = [record("muon", 0.01, 1.0), record("muon", 0.02, 1.1), record("muon", 0.01, 1.3, "polar_express_4"),
               record("muon", 0.02, 1.2, "polar_express_4"), record("muon", 0.04, 0.5, "polar_express_3")]
    argv = ["--model", "llama-384", "--optimizers", "muon", "--compile", "--horizons", "6000", "--seeds", "0"]
    rerun = study.plan_best_runs(study.parse_args(argv + ["--ns-coefficients", "polar_express,polar_express_4"]), records)
    assert sorted((r.ns_coefficients, r.lr, r.horizon) for r in rerun) == [("polar_express", 0.01, 6000),
                                                                           ("polar_express_4", 0.02, 6000)]
    assert [(r.ns_coefficients, r.lr) for r in study.plan_best_runs(study.parse_args(argv), records)] == [("polar_express", 0.01)]


@pytest.mark.slow
def test_smoke_study_runs_with_a_four_step_schedule(study, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = (ROOT / "src" / "dion3" / "rules.py").read_bytes()
    for i in range(12):
        (corpus / f"f{i}.py").write_bytes(text[i * 500:(i + 1) * 500 + 2000])
    out = tmp_path / "study"
    assert study.main(["--smoke", "--seeds", "0", "--fraction-warmup", "0", "--ns-coefficients", "polar_express_4",
                       "--data", str(corpus), "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["config"]["optimizer"] for r in records) == ["dion3", "normuon"]
    assert all(r["config"]["ns_coefficients"] == "polar_express_4" and math.isfinite(r["final_val_loss"])
               and r["optimizer_tflop"] > 0 and not r["nonfinite_updates"] for r in records)
    summary = (out / "summary.md").read_text()
    assert "| NorMuon, 4 NS steps |" in summary and "| Dion3, 4 NS steps | 1/4 on every matrix |" in summary


def test_summary_names_cost_allocation_and_averages_optimizer_flops(study):
    records = [_record(study, "dion3", 1.40, 0, 0.25, allocation="cost", tflop=2.0),
               _record(study, "dion3", 1.42, 1, 0.25, allocation="cost", tflop=3.0),
               _record(study, "dion3", 1.50, 0, 0.25, tflop=4.0),
               _record(study, "dion3", 1.60, 0, 0.25)]  # an older record without optimizer FLOPs
    del records[3]["config"]["fraction_allocation"]
    for record in records[:2]:
        record["config"]["cost_rule"] = "time"
    flop_rule = _record(study, "dion3", 1.45, 0, 0.25, allocation="cost", tflop=5.0)  # a record from before the time rule
    cost, old, fixed = study.summary_table(records + [flop_rule]).splitlines()[2:]
    assert "| Dion3 | 1/4 by cost |" in cost and cost.endswith("| 2.5 |")
    assert "| Dion3 | 1/4 by cost (FLOP rule) |" in old and old.endswith("| 5 |")
    assert "| Dion3 | 1/4 on every matrix |" in fixed and fixed.endswith("| — |")  # one of its two records has no count


def test_a_budget_warmed_up_by_cost_trains_from_every_row_to_its_fractions(study):
    """A study run of fractions by cost with a warm-up (trainer.train, as the study's child runs
    it): the first step selects every row, the last the fractions by cost of the budget; the
    summary names the setting apart from the fixed one."""
    import dataclasses

    import torch

    from dion3.tools.train import data, trainer
    from dion3.tools.train.model import GPTConfig

    config = GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64)
    tokens = torch.tensor(list((b"def f(x):\n    return x + 1\n" * 200)[:3000]))
    corpus = data.TokenData(tokens[:2500], tokens[2500:], 256, "periodic")
    spec = trainer.RunSpec("d", "dion3", 0.02, 0.25, 0.6, fraction_warmup=4, fraction_allocation="cost")
    result = trainer.train(spec, config, trainer.Schedule(steps=6, batch_size=2, eval_every=6, eval_batches=1), corpus,
                           torch.device("cpu"))
    from dion3.optim.fraction_schedule import FractionWarmup

    def fractions_at(budget: float) -> list[float]:  # the groups by cost of one fixed budget
        fixed = trainer.build_optimizer(trainer.GPT(dataclasses.replace(config, vocab_size=256)),
                                        dataclasses.replace(spec, fraction=budget, fraction_warmup=0)).param_groups
        return [g["fraction"] for g in fixed if g["algorithm"] == "dion3"]

    # the allocation need not fall with the budget (a shape may hold fewer rows at a larger budget
    # that buys others more): the range spans every budget the warm-up visits
    visited = [fraction for step in range(6) for fraction in fractions_at(FractionWarmup(0.25, 4)(step))]
    assert len(set(fractions_at(0.25))) > 1 and result.fraction_range == (min(visited), 1.0)
    assert all(math.isfinite(loss) for loss in result.val_losses)
    record = _record(study, "dion3", 1.5, 0, 0.25, 50, allocation="cost")
    record["config"]["cost_rule"] = "time"
    assert "| Dion3 | 1 → 1/4 by cost over 50 steps |" in study.summary_table([record])


def test_summary_is_mean_and_standard_deviation_over_seeds(study):
    records = [
        _record(study, "normuon", 1.50, 0, ms=3.0), _record(study, "normuon", 1.60, 1, ms=5.0),
        _record(study, "normuon", 1.70, 2, ms=4.0),
        _record(study, "dion3", 1.40, 0, 0.25, 100, average=0.4375, ms=1.0, train=1.30),
        _record(study, "dion3", 1.44, 1, 0.25, 100, average=0.4375, ms=3.0, train=1.20),
    ]
    table = study.summary_table(records).splitlines()
    assert len(table) == 2 + 2
    dion3, normuon = table[2], table[3]  # best mean loss first
    # the rows' average fraction is the share of rows orthogonalized, not the budget (by cost they differ)
    assert "| optimizer | fraction budget |" in table[0] and "| share of rows orthogonalized |" in table[0]
    assert "| Dion3 | 1 → 1/4 over 100 steps |" in dion3 and "| 2 | 0 | 0 | 1.4200 ± 0.0283 | 1.2500 | 0.438 | 2.00 |" in dion3
    assert f"{statistics.stdev([1.5, 1.6, 1.7]):.4f}" == "0.1000"
    assert "| NorMuon | — |" in normuon and "| 3 | 0 | 0 | 1.6000 ± 0.1000 | — | 1.000 | 4.00 |" in normuon  # records without a train loss


def test_a_non_finite_run_is_counted_apart_never_averaged(study):
    records = [_record(study, "normuon", 1.50, 0), _record(study, "normuon", math.nan, 1), _record(study, "normuon", 1.70, 2)]
    records[2]["nonfinite_updates"] = 3
    row = study.summary_table(records).splitlines()[2]
    assert "| 3 | 1 | 3 | 1.6000 ± 0.1414 |" in row  # mean and sd of 1.5 and 1.7 only


@pytest.mark.slow
def test_smoke_study_writes_one_line_per_run_and_skips_finished_runs(study, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = (ROOT / "src" / "dion3" / "rules.py").read_bytes()
    for i in range(12):
        (corpus / f"f{i}.py").write_bytes(text[i * 500:(i + 1) * 500 + 2000])
    out = tmp_path / "study"
    base = ["--smoke", "--data", str(corpus), "--out", str(out)]
    assert study.main(base + ["--seeds", "0"]) == 0
    first = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(first) == 3  # NorMuon, Dion3 fixed, Dion3 with a 4-step warm-up, at 8 steps
    for record in first:
        assert record["horizon"] == 8 and record["seed"] == 0 and record["config"]["model"] == "gpt-tiny"
        assert record["final_val_loss"] < math.log(256) and record["optimizer_ms_median"] > 0  # below the uniform loss
        assert 0 < record["final_train_loss"] < math.log(256)
        assert record["optimizer_tflop"] > 0  # NorMuon and Dion3 both orthogonalize
    # each run's log says how far it came: its last progress line is the last step
    logs = list((out / "logs").glob("*.log"))
    assert len(logs) == 3 and all("step 8/8: " in log.read_text() for log in logs)
    fractions = sorted(r["average_fraction"] for r in first)
    # fixed ¼; warm-up 1 → ¼ over 4 steps then ¼: (1 + 0.8125 + 0.625 + 0.4375 + 4·0.25)/8; NorMuon: every row
    assert fractions == [0.25, pytest.approx((1 + 0.8125 + 0.625 + 0.4375 + 1.0) / 8), 1.0]
    # a study killed while writing leaves a cut line: ignored, and seed 1's runs are added
    with open(out / "results.jsonl", "a") as handle:
        handle.write('{"key": "cut sh')
    capsys.readouterr()
    assert study.main(base) == 0
    printed = capsys.readouterr().out
    assert "6 runs, 3 already in" in printed and "3 to run" in printed
    records = study.read_results(out / "results.jsonl")
    assert len(records) == 6 and records[:3] == first
    summary = (out / "summary.md").read_text()
    assert summary.count("| gpt-tiny | 8 |") == 3 and summary.count("| 2 |") == 3
    # each run records how many of the study's runs shared the device (--jobs, 2 in smoke mode)
    assert {r["runs_at_once"] for r in records} == {2} and "with up to 2 runs of one study sharing" in summary


def test_progress_lines_come_at_even_steps_and_end_at_the_last(capsys):
    from dion3.tools.study.child import progress_printer

    step = progress_printer(25, lines=5)
    for _ in range(25):
        step()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"step {n}/25" for n in (5, 10, 15, 20, 25)]
    assert lines[-1].endswith("about 0.0 min left")


def test_summary_says_how_many_runs_shared_the_device_from_the_records(study, tmp_path):
    old = {**_record(study, "normuon", 1.5, 0)}
    crowd = [{**_record(study, "normuon", 1.6, seed), "runs_at_once": jobs} for seed, jobs in ((1, 16), (2, 4))]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [old, *crowd]))
    study.write_summary(tmp_path)
    assert "with up to 16 runs of one study sharing the device (1 older records do not say how many)" \
        in (tmp_path / "summary.md").read_text()
    (tmp_path / "results.jsonl").write_text(json.dumps(old) + "\n")
    study.write_summary(tmp_path)
    assert "with an unrecorded number of runs sharing the device" in (tmp_path / "summary.md").read_text()


def test_dry_run_lists_the_plan_against_the_results_and_runs_nothing(study, tmp_path, capsys):
    args = ["--model", "gpt-tiny", "--horizons", "8", "--seeds", "0,1", "--optimizers", "normuon", "--normuon-lr", "0.02",
            "--normuon-mu", "0.6", "--out", str(tmp_path)]
    planned = study.plan_runs(study.parse_args(args))
    finished = {**_record(study, "normuon", 1.5, 0), "key": planned[0].key}
    (tmp_path / "results.jsonl").write_text(json.dumps(finished) + "\n")
    before = (tmp_path / "results.jsonl").read_text()
    assert study.main(args + ["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"done    {planned[0].label}", f"to run  {planned[1].label}"]
    assert lines[2].startswith("2 runs, 1 already in") and lines[2].endswith("1 to run, 8 steps in all")
    assert (tmp_path / "results.jsonl").read_text() == before and not (tmp_path / "logs").exists()


def test_dry_run_lists_the_rule_variants(study, tmp_path, capsys):
    args = ["--model", "gpt-tiny", "--horizons", "8", "--seeds", "0", "--optimizers", "dion3", "--dion3-lr", "0.02",
            "--dion3-mu", "0.6", "--fraction", "0.5", "--fraction-warmup", "0", "--fraction-allocation", "cost",
            "--unselected-decay", "0.9,0.97", "--full-every", "0,8", "--out", str(tmp_path), "--dry-run"]
    assert study.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"to run  dion3-1/2-cost-{variant} lr=0.02 mu=0.6 h=8 seed=0" for variant in (
        "unselected0.9", "unselected0.9-full-every8", "unselected0.97", "unselected0.97-full-every8")] + [
        "4 runs, 0 already in " + str(tmp_path / "results.jsonl") + ", 4 to run, 32 steps in all"]


def block_matrix_parameters(spec) -> int:
    """Weights of the attention and MLP matrices of a llama-hf spec, counted by hand."""
    head = spec.d_model // spec.n_head
    attention = 2 * spec.d_model * spec.d_model + 2 * spec.d_model * spec.kv_heads * head
    return spec.n_layer * (attention + 3 * spec.d_model * spec.mlp_width)


@pytest.mark.parametrize("name, millions, tolerance", [("llama-hf", 25, 0.05), ("llama-hf-110m", 110, 0.05),
                                                       ("llama-hf-350m", 350, 0.05)])
def test_the_scale_trend_shapes_have_their_sizes_and_one_token_budget(study, name, millions, tolerance):
    spec = study.MODELS[name]
    assert spec.kind == "llama-hf" and spec.d_model // spec.n_head == 64
    assert spec.batch_size * spec.seq_len == 16 * 512
    assert abs(block_matrix_parameters(spec) / 1e6 - millions) <= tolerance * millions


def test_the_built_model_holds_the_counted_block_matrices(study):
    pytest.importorskip("transformers")
    import torch
    from dion3.tools.train.model import GPTConfig
    spec = study.MODELS["llama-hf-110m"]
    with torch.device("meta"):
        model = study.build_llama(spec)(GPTConfig(seq_len=spec.seq_len, n_layer=spec.n_layer, n_head=spec.n_head,
                                                   d_model=spec.d_model, vocab_size=256))
    blocks = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and ".layers." in name)
    assert blocks == block_matrix_parameters(spec)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-25m", "gpt-120m", "llama-hf", "llama-384", "llama-hf-110m",
                                  "llama-hf-350m"])
def test_the_registry_lists_the_shapes_of_the_model_the_study_builds(study, name):
    """The shapes the registry of model names gives a study model (what `dion3 bench`, `dion3
    plan` and `dion3 fractions` run under its name) are those of the model the study trains,
    built on the meta device as a run builds it (byte data): its matrices, as param_groups finds
    them, and its other parameters (embedding, LM head, norms)."""
    import dataclasses

    import torch

    from dion3 import param_groups
    from dion3.tools.models import REGISTRY
    from dion3.tools.train.model import GPT, GPTConfig, padded_vocab

    spec = study.MODELS[name]
    if spec.kind == "llama-hf":
        pytest.importorskip("transformers")
    config = GPTConfig(seq_len=spec.seq_len, n_layer=spec.n_layer, n_head=spec.n_head, d_model=spec.d_model)
    factory = GPT if spec.kind == "gpt" else study.build_llama(spec)
    with torch.device("meta"):
        model = factory(dataclasses.replace(config, vocab_size=padded_vocab(256)))  # as trainer.train does
    groups = param_groups(model, lm_head=model.lm_head)
    built = (sorted(tuple(p.shape) for g in groups if "algorithm" not in g for p in g["params"]),
             sorted(tuple(p.shape) for g in groups if g.get("algorithm") == "adamw" for p in g["params"]))
    assert sum(map(len, built)) == len(list(model.parameters()))
    preset = REGISTRY[name].preset()
    listed = (sorted((m.rows, m.cols) for m in preset.matrices for _ in range(m.count)),
              sorted(s.shape for s in preset.scalars for _ in range(s.count)))
    assert built == listed
    assert preset.layers == spec.n_layer


def test_the_study_refuses_a_model_it_does_not_train_naming_the_commands_that_take_it(study, capsys):
    with pytest.raises(SystemExit):
        study.parse_args(["--model", "llama-8b"])
    assert ("--model: 'llama-8b' is not a model the study trains (gpt-120m, gpt-25m, gpt-tiny, llama-384, llama-512-6l, "
            "llama-hf, llama-hf-110m, llama-hf-350m: each with its context and batch); 'llama-8b' is taken by dion3 bench --preset, "
            "dion3 plan --preset and dion3 fractions --preset") in capsys.readouterr().err


def test_train_step_times_each_setting_with_its_own_optimizer(tmp_path, capsys):
    """`python -m dion3.tools.study.train_step` on the CPU: a row per setting, the optimizer step
    inside the whole step, the study's optimizers (AdamW has no matrix step to speak of), and
    clear errors for what it cannot do."""
    from dion3.tools.study import train_step

    out = tmp_path / "steps.json"
    assert train_step.main(["--model", "gpt-tiny", "--settings", "adamw,muon,dion3-1/4-cost", "--steps", "2",
                            "--warmup", "1", "--rounds", "2", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = {row["setting"]: row for row in record["rows"]}
    assert set(rows) == {"adamw", "muon", "dion3-1/4-cost"} and all(row["mode"] == "eager" for row in rows.values())
    for row in rows.values():
        assert 0 < row["optimizer_ms"] < row["total_ms"]
        assert row["tokens_per_second"] == pytest.approx(4 * 32 / (row["total_ms"] / 1e3))  # gpt-tiny: 4 × 32 tokens
    printed = capsys.readouterr().out
    assert printed.count("round ") == 6 and "| gpt-tiny | muon | eager |" in printed
    spec = train_step.run_spec("dion3-3/8-cost")
    assert (spec.algorithm, spec.fraction, spec.fraction_allocation) == ("dion3", 0.375, "cost")
    for bad in ("dion3-2-cost", "sgd"):
        with pytest.raises(SystemExit, match="train_step: "):
            train_step.run_spec(bad)
    with pytest.raises(SystemExit):
        train_step.main(["--model", "gpt-tiny", "--captured", "--device", "cpu"])
    assert "--captured captures CUDA graphs" in capsys.readouterr().err


def test_progress_lines_count_the_processes_on_the_gpu_with_the_sampler(capsys):
    from dion3.tools.study.child import progress_printer

    answers = iter([3, None])
    seen: list = []
    step = progress_printer(4, lines=2, sample=lambda: next(answers), samples=seen)
    for _ in range(4):
        step()
    lines = capsys.readouterr().out.splitlines()
    assert seen == [3, None]
    assert lines[0].endswith("3 processes on the GPU") and lines[1].endswith("? processes on the GPU")


def _fake_nvidia_smi(tmp_path, monkeypatch, listing):
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\ncat <<'END'\n" + listing + "END\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")


def test_gpu_process_count_counts_the_runs_gpu_only_and_zero_is_unknown(tmp_path, monkeypatch):
    """nvidia-smi's rows are matched to the run's GPU by UUID (its "GPU-" prefix dropped); a count
    of 0 cannot be right (the run itself holds a context), so it reads as unknown; a CPU is None."""
    import torch

    from dion3.tools.study import child

    class Properties:
        uuid = "aaaa-1111"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    _fake_nvidia_smi(tmp_path, monkeypatch, "GPU-AAAA-1111, 101\nGPU-bbbb-2222, 102\nGPU-aaaa-1111, 103\nGPU-aaaa-1111, 104\n")
    assert child.gpu_process_count(torch.device("cuda", 0)) == 3
    _fake_nvidia_smi(tmp_path, monkeypatch, "GPU-bbbb-2222, 102\n")
    assert child.gpu_process_count(torch.device("cuda", 0)) is None
    assert child.gpu_process_count(torch.device("cpu")) is None


def test_summary_says_how_many_processes_were_seen_on_the_gpu(study, tmp_path):
    records = [{**_record(study, "normuon", 1.5, 0), "runs_at_once": 1, "gpu_processes_max": 5},
               {**_record(study, "normuon", 1.6, 1), "runs_at_once": 1, "gpu_processes_max": None}]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    study.write_summary(tmp_path)
    assert ("with up to 1 runs of one study sharing the device, up to 5 processes seen on the GPU "
            "(1 of 2 runs counted them)") in (tmp_path / "summary.md").read_text()
