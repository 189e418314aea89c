"""dion3.tools.study.frontier: the best setting per variant, the join with `dion3 bench` step times,
the two picks, and the command's table and picture, on hand-made records whose answers are
worked out here."""
from __future__ import annotations

import json

import pytest

from dion3.tools.study import frontier


def record(optimizer, lr, mu, seed, loss, fraction=None, allocation="uniform", cost_rule="time", **config):
    base = dict(model="tiny", optimizer=optimizer, lr=lr, mu=mu, fraction=fraction, fraction_warmup=0, horizon=100,
                seed=seed, compiled=True, momentum_dtype=None, fraction_allocation=allocation,
                cost_rule=cost_rule if allocation == "cost" else None)
    base.update(config)
    return {"config": base, "seed": seed, "final_val_loss": loss}


RECORDS = [
    # Muon: lr 0.01 (mean 0.700, sd 0.002) beats lr 0.02 (0.710)
    record("muon", 0.01, 0.8, 0, 0.698), record("muon", 0.01, 0.8, 1, 0.700), record("muon", 0.01, 0.8, 2, 0.702),
    record("muon", 0.02, 0.8, 0, 0.710),
    record("normuon", 0.02, 0.6, 0, 0.690), record("normuon", 0.02, 0.6, 1, 0.692),
    # Dion3 3/8 by cost: mean 0.7015 ≤ 0.700 + 0.002; 1/4 by cost: 0.712, outside
    record("dion3", 0.02, 0.6, 0, 0.701, 0.375, "cost"), record("dion3", 0.02, 0.6, 1, 0.702, 0.375, "cost"),
    record("dion3", 0.03, 0.6, 0, 0.712, 0.25, "cost"), record("dion3", 0.03, 0.6, 1, 0.712, 0.25, "cost"),
    # left out: another horizon, the FLOP rule, bf16 momentum, eager, a warm-up, a NaN
    record("dion3", 0.03, 0.6, 0, 0.600, 0.25, "cost", horizon=50),
    record("dion3", 0.03, 0.6, 0, 0.600, 0.125, "cost", cost_rule=None),
    record("muon", 0.01, 0.8, 3, 0.500, momentum_dtype="bfloat16"),
    record("normuon", 0.02, 0.6, 3, 0.500, compiled=False),
    record("dion3", 0.03, 0.6, 0, 0.600, 0.5, fraction_warmup=200),
    record("muon", 0.005, 0.8, 0, float("nan")),
]


def bench_report(preset, times):
    rows = []
    for (algorithm, fraction, allocation, orthogonalizer), (eager, graph) in times.items():
        variant = dict(algorithm=algorithm, fraction=fraction, allocation=allocation, orthogonalizer=orthogonalizer,
                       kernels=orthogonalizer == "auto", warmup_steps=None, momentum_dtype=None)
        rows += [dict(name=f"{algorithm}-{fraction}", mode="eager", device_ms=eager, variant=variant),
                 dict(name=f"{algorithm}-{fraction}", mode="graph", device_ms=graph, variant=variant)]
    return {"source": {"name": preset}, "results": rows}


TIMES = {("muon", None, "uniform", "auto"): (600.0, 598.0), ("muon", None, "uniform", "newton_schulz"): (1200.0, 1190.0),
         ("normuon", None, "uniform", "auto"): (601.0, 600.0), ("dion3", 0.375, "cost", "auto"): (240.0, 239.0),
         ("dion3", 0.25, "cost", "auto"): (160.0, 159.0)}


def test_best_points_pick_the_lowest_mean_and_leave_out_what_does_not_compare():
    best = frontier.best_points(RECORDS, "tiny", 100, compiled=True)
    muon = best[frontier.Variant("muon")]
    assert (muon.lr, muon.losses) == (0.01, [0.698, 0.700, 0.702])
    assert muon.mean == pytest.approx(0.700) and muon.sd == pytest.approx(0.002)
    assert best[frontier.Variant("normuon")].losses == [0.690, 0.692]  # not the eager run's 0.5
    assert set(best) == {frontier.Variant("muon"), frontier.Variant("normuon"), frontier.Variant("dion3", 0.375, "cost"),
                         frontier.Variant("dion3", 0.25, "cost")}  # no FLOP rule, no warm-up


def test_the_best_is_the_lowest_mean_among_the_most_seeded_and_a_rival_ahead_on_fewer_is_named():
    # lr 0.01 won the seed-0 sweep (0.700 < 0.701) and then ran seeds 1 and 2 (mean 0.704); lr 0.02's one
    # seed (0.701) is below that mean but has no spread: lr 0.01 stays the best, with no rival named
    records = [record("muon", 0.01, 0.8, 0, 0.700), record("muon", 0.01, 0.8, 1, 0.704), record("muon", 0.01, 0.8, 2, 0.708),
               record("muon", 0.02, 0.8, 0, 0.701)]
    muon = frontier.best_points(records, "tiny", 100, compiled=True)[frontier.Variant("muon")]
    assert (muon.lr, muon.losses, muon.unconfirmed) == (0.01, [0.700, 0.704, 0.708], [])
    # lr 0.02 wins seed 0 (0.699): still one seed, so lr 0.01 is the point, and lr 0.02 is the rival to confirm
    swapped = records[:3] + [record("muon", 0.02, 0.7, 0, 0.699)]
    muon = frontier.best_points(swapped, "tiny", 100, compiled=True)[frontier.Variant("muon")]
    assert (muon.lr, muon.unconfirmed) == (0.01, [(0.02, 0.7, [0])])


def test_step_times_join_the_default_muon_not_the_baseline(tmp_path):
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(bench_report("llama-8b", TIMES)))
    presets, times = frontier.read_steps([path])
    assert presets == ["llama-8b"]
    assert times[frontier.Variant("muon")] == {("llama-8b", "eager"): 600.0, ("llama-8b", "graph"): 598.0}
    assert times[frontier.Variant("dion3", 0.375, "cost")][("llama-8b", "eager")] == 240.0
    both = tmp_path / "both.json"  # a list of reports: one file for several presets
    both.write_text(json.dumps([bench_report("llama-8b", TIMES), bench_report("llama-1b", {("muon", None, "uniform", "auto"): (47.0, 46.0)})]))
    presets, times = frontier.read_steps([both])
    assert presets == ["llama-8b", "llama-1b"] and times[frontier.Variant("muon")][("llama-1b", "graph")] == 46.0


def test_muon_quality_is_the_cheapest_dion3_within_one_sd_of_muon(tmp_path):
    best = frontier.best_points(RECORDS, "tiny", 100, compiled=True)
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(bench_report("llama-8b", TIMES)))
    _, times = frontier.read_steps([path])
    for point in best.values():
        point.step_ms = times.get(point.variant, {})
    chosen = frontier.picks(list(best.values()), ("llama-8b", "eager"))
    assert chosen["muon quality"].variant == frontier.Variant("dion3", 0.375, "cost")  # 0.7015 ≤ 0.702
    assert chosen["fastest"].variant == frontier.Variant("dion3", 0.25, "cost")


def command_inputs(tmp_path, records=RECORDS):
    """(the command's --results/--steps/--out arguments for `records` and TIMES, the out folder)."""
    results = tmp_path / "study"
    results.mkdir()
    (results / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps(bench_report("llama-8b", TIMES)))
    out = tmp_path / "out"
    return ["--results", str(results), "--steps", str(steps), "--out", str(out)], out


def test_the_command_writes_the_table_and_the_picture(tmp_path):
    common, out = command_inputs(tmp_path)
    assert frontier.main(common + ["--horizon", "100"]) == 0
    text = (out / "frontier.md").read_text()
    assert "| Dion3 3⁄8 by cost | 0.02 | 0.6 | 2 | 0.7015 ± 0.0007 | +0.0015 | 240.0 / 239.0 | 0.40 |" in text
    assert "- muon quality: Dion3 3⁄8 by cost" in text and "0.40× Muon's" in text
    assert (out / "frontier.png").stat().st_size > 10_000 and "](frontier.png)" in text


def test_a_second_horizon_writes_its_own_files_beside_the_first(tmp_path):
    # the records at horizon 50 hold one 1/4-by-cost run (0.600): at --horizon 50 it is the only
    # point, and --name keeps the horizon-100 files as they were
    common, out = command_inputs(tmp_path)
    assert frontier.main(common + ["--horizon", "100"]) == 0
    first = (out / "frontier.md").read_text()
    assert frontier.main(common + ["--horizon", "50", "--name", "frontier-50"]) == 0
    second = (out / "frontier-50.md").read_text()
    assert (out / "frontier.md").read_text() == first
    assert second.startswith("# Frontier at 50 steps") and "](frontier-50.png)" in second
    assert "| Dion3 1⁄4 by cost | 0.03 | 0.6 | 1 | 0.6000 ± 0.0000 |" in second
    assert "Muon |" not in second  # no Muon run at 50 steps
    assert (out / "frontier-50.png").stat().st_size > 10_000


def test_the_picture_has_a_panel_per_model_with_timed_points(tmp_path):
    """Two models with timed points give two panels in one file; a model whose points have no step
    time on the axis gets none, and no timed point at all writes nothing."""
    axis = ("llama-8b", "eager")
    timed = [frontier.Point(frontier.Variant("muon"), 0.01, 0.8, [0.70, 0.71], {axis: 600.0}),
             frontier.Point(frontier.Variant("dion3", 0.375, "cost"), 0.02, 0.6, [0.705], {axis: 240.0})]
    untimed = [frontier.Point(frontier.Variant("adamw"), 5e-4, 0.0, [0.75], {})]
    path = tmp_path / "frontier.png"
    drawn = frontier.frontier_picture([("a", timed), ("b", untimed), ("c", timed[:1])], axis, path)
    assert drawn == ["a", "c"] and path.stat().st_size > 10_000
    from PIL import Image

    assert frontier.frontier_picture([("a", timed)], axis, tmp_path / "one.png") == ["a"]
    with Image.open(path) as both, Image.open(tmp_path / "one.png") as one:  # stacked: twice one panel's height
        assert both.size[1] == pytest.approx(2 * one.size[1], abs=2)
    assert frontier.frontier_picture([("b", untimed)], axis, tmp_path / "none.png") == []
    assert not (tmp_path / "none.png").exists()


def test_across_sizes_picks_the_cheapest_setting_within_muon_sd_at_every_seeded_size(tmp_path):
    # two sizes: 3/8 by cost is within on "a" but outside on "b"; 1/2 by cost within on both;
    # "c" has a one-seed Muon (no spread) and does not count
    def size(model, quarter, three8, half):
        rows = [record("muon", 0.01, 0.8, s, loss, model=model) for s, loss in ((0, 0.700), (1, 0.702))]
        for fraction, losses in ((0.25, quarter), (0.375, three8), (0.5, half)):
            rows += [record("dion3", 0.02, 0.6, s, loss, fraction, "cost", model=model) for s, loss in enumerate(losses)]
        return rows
    records = size("a", (0.71, 0.71), (0.701, 0.702), (0.7015, 0.7025)) + size("b", (0.72, 0.72), (0.705, 0.706), (0.701, 0.702))
    records += [record("muon", 0.01, 0.8, 0, 0.69, model="c"), record("dion3", 0.02, 0.6, 0, 0.80, 0.5, "cost", model="c"),
                record("dion3", 0.02, 0.6, 1, 0.80, 0.5, "cost", model="c")]
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps(bench_report("llama-8b", {**TIMES, ("dion3", 0.5, "cost", "auto"): (290.0, 289.0)})))
    _, times = frontier.read_steps([steps])
    panels = []
    for model in ("a", "b", "c"):
        points = list(frontier.best_points(records, model, 100, compiled=True).values())
        for point in points:
            point.step_ms = times.get(point.variant, {})
        panels.append((model, points))
    text = frontier.across_sizes(panels, ("llama-8b", "eager"))
    # muon: mean 0.701, sd 0.00141 → limit 0.70241; 3/8 on b: 0.7055 (outside); 1/2: 0.702 and 0.7015 (within)
    assert "| Dion3 3⁄8 by cost | +0.0005 (within) | +0.0045 (outside) | 240.0 |" in text
    assert "| Dion3 1⁄2 by cost | +0.0010 (within) | +0.0005 (within) | 290.0 |" in text
    assert "- muon quality at every size: Dion3 1⁄2 by cost" in text and "| c" not in text


def test_an_l2_row_score_is_its_own_point_timed_as_the_l1_rule(tmp_path):
    records = [record("dion3", 0.015, 0.6, s, 0.70 + s / 1000, 0.375, "cost") for s in (0, 1)]
    records += [record("dion3", 0.015, 0.6, s, 0.69 + s / 1000, 0.375, "cost", row_score="l2") for s in (0, 1)]
    best = frontier.best_points(records, "tiny", 100, compiled=True)
    l1, l2 = frontier.Variant("dion3", 0.375, "cost"), frontier.Variant("dion3", 0.375, "cost", "l2")
    assert set(best) == {l1, l2} and best[l2].mean == pytest.approx(0.6905)
    assert l2.label == "Dion3 3⁄8 by cost, rows by L2"
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps(bench_report("llama-8b", TIMES)))
    _, times = frontier.read_steps([steps])
    assert times.get(frontier._rounded(l2)) == times[l1] == {("llama-8b", "eager"): 240.0, ("llama-8b", "graph"): 239.0}



def test_rule_variants_are_points_of_their_own_that_the_rule_s_bench_rows_do_not_time(tmp_path):
    """Runs with unselected_decay or full_every never pool with ½ by cost's records (a variant with
    a lower loss stays its own point, labelled apart), and get no step time from the rule's bench
    row (their step does more); the rule's point keeps its records, its time and the picks."""
    records = [record("dion3", 0.02, 0.6, s, 0.70 + s / 1000, 0.5, "cost") for s in (0, 1)]
    records += [record("dion3", 0.02, 0.6, s, 0.69 + s / 1000, 0.5, "cost", unselected_decay=0.9) for s in (0, 1)]
    records += [record("dion3", 0.03, 0.6, s, 0.68 + s / 1000, 0.5, "cost", full_every=8) for s in (0, 1)]
    best = frontier.best_points(records, "tiny", 100, compiled=True)
    rule = frontier.Variant("dion3", 0.5, "cost")
    decayed = frontier.Variant("dion3", 0.5, "cost", unselected_decay=0.9)
    full = frontier.Variant("dion3", 0.5, "cost", full_every=8)
    assert set(best) == {rule, decayed, full}
    assert best[rule].losses == [0.70, 0.701] and best[decayed].losses == [0.69, 0.691] and best[full].lr == 0.03
    assert decayed.label == "Dion3 1⁄2 by cost, unselected rows ×0.9 a step"
    assert full.label == "Dion3 1⁄2 by cost, all rows every 8 steps"
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps(bench_report("llama-8b", {("dion3", 0.5, "cost", "auto"): (300.0, 299.0)})))
    _, times = frontier.read_steps([steps])
    assert times[rule] == {("llama-8b", "eager"): 300.0, ("llama-8b", "graph"): 299.0}
    assert frontier._rounded(decayed) not in times and frontier._rounded(full) not in times
    for variant, point in best.items():
        point.step_ms = times.get(frontier._rounded(variant), {})
    assert frontier.picks(list(best.values()), ("llama-8b", "eager"))["fastest"].variant == rule
    from dion3.tools.study.efficiency import setting_name

    assert setting_name(rule) == "dion3-1/2-cost" and setting_name(decayed) == decayed.label


def test_rule_variants_are_timed_by_the_bench_rows_that_name_them(tmp_path):
    """A real `dion3 bench` report (CPU) of ½ by cost, its -unselected0.9 and its -full-every4 rows:
    each study point of those rules takes its own row's time, not the rule's."""
    from dion3.tools.bench import step_time

    path = tmp_path / "steps.json"
    assert step_time.main(["--device", "cpu", "--shapes", "16x32:2,64x32", "--steps", "4", "--warmup", "1", "--json",
                           str(path), "--optimizers",
                           "dion3-1/2-cost,dion3-1/2-cost-unselected0.9,dion3-1/2-cost-full-every4"]) == 0
    rows = {row["name"]: row["device_ms"] for row in json.loads(path.read_text())["results"]}
    _, times = frontier.read_steps([path])
    for variant, name in ((frontier.Variant("dion3", 0.5, "cost"), "dion3-1/2-cost"),
                          (frontier.Variant("dion3", 0.5, "cost", unselected_decay=0.9), "dion3-1/2-cost-unselected0.9"),
                          (frontier.Variant("dion3", 0.5, "cost", full_every=4), "dion3-1/2-cost-full-every4")):
        assert times[frontier._rounded(variant)] == {("custom", "eager"): rows[name]}, name


def test_a_four_step_schedule_is_its_own_point_timed_by_its_own_bench_rows(tmp_path):
    """Runs with ns_coefficients polar_express_4 are their own points, labelled with their step
    count and timed by the rows of `dion3 bench --ns-coefficients polar_express_4` (a second report
    of the same preset: one column); Muon's best stays the default schedule's, the reference of
    the gaps and picks, even where a 4-step Muon has the lower loss."""
    four = dict(ns_coefficients="polar_express_4")
    records = RECORDS + [record("muon", 0.01, 0.8, s, 0.690 + s / 1000, **four) for s in (0, 1, 2)]
    records += [record("dion3", 0.02, 0.6, s, 0.7000 + s / 1000, 0.375, "cost", **four) for s in (0, 1)]
    best = frontier.best_points(records, "tiny", 100, compiled=True)
    muon4, dion4 = frontier.Variant("muon", ns_coefficients="polar_express_4"), frontier.Variant("dion3", 0.375, "cost", **four)
    assert best[frontier.Variant("muon")].mean == pytest.approx(0.700) and best[muon4].mean == pytest.approx(0.691)
    assert muon4.label == "Muon, 4 NS steps" and dion4.label == "Dion3 3⁄8 by cost, 4 NS steps"
    fewer = bench_report("llama-8b", {("muon", None, "uniform", "auto"): (500.0, 499.0),
                                      ("dion3", 0.375, "cost", "auto"): (200.0, 199.0)})
    for row in fewer["results"]:
        row["variant"]["ns_coefficients"] = "polar_express_4"
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps([bench_report("llama-8b", TIMES), fewer]))
    presets, times = frontier.read_steps([steps])
    assert presets == ["llama-8b"] and times[dion4][("llama-8b", "eager")] == 200.0
    assert times[frontier.Variant("dion3", 0.375, "cost")][("llama-8b", "eager")] == 240.0
    results = tmp_path / "study"
    results.mkdir()
    (results / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "out"
    assert frontier.main(["--results", str(results), "--steps", str(steps), "--out", str(out), "--horizon", "100"]) == 0
    text = (out / "frontier.md").read_text()
    assert text.count("llama-8b ms (eager / graph)") == 1
    assert "| Muon, 4 NS steps | 0.01 | 0.8 | 3 | 0.6910 ± 0.0010 | -0.0090 | 500.0 / 499.0 | 0.83 |" in text
    assert "| Dion3 3⁄8 by cost, 4 NS steps | 0.02 | 0.6 | 2 | 0.7005 ± 0.0007 | +0.0005 | 200.0 / 199.0 | 0.33 |" in text
    assert "- muon quality: Dion3 3⁄8 by cost, 4 NS steps (lr 0.02, μ 0.6), 0.7005 ± 0.0007, +0.0005 against Muon's best" \
        in text


def test_a_train_step_report_beside_the_bench_reports_adds_the_models_whole_step(tmp_path):
    """train_step's rows join their settings (dion3-3/8-cost is the 3/8-by-cost point), only in the
    table of the model they timed; the bench reports' columns are unchanged."""
    results = tmp_path / "study"
    results.mkdir()
    (results / "results.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    whole = {"model": "tiny", "compiled": True, "rows": [
        dict(setting="muon", mode="eager", total_ms=30.0, optimizer_ms=10.0, tokens_per_second=1.0),
        dict(setting="muon", mode="captured", total_ms=25.5, optimizer_ms=1.5, tokens_per_second=1.0),
        dict(setting="dion3-3/8-cost", mode="captured", total_ms=24.25, optimizer_ms=1.25, tokens_per_second=1.0)]}
    other = {"model": "other", "compiled": True, "rows": [
        dict(setting="muon", mode="eager", total_ms=99.0, optimizer_ms=9.0, tokens_per_second=1.0)]}
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps([bench_report("llama-8b", TIMES), whole, other]))
    presets, times = frontier.read_steps([steps])
    assert presets == ["llama-8b"]
    out = tmp_path / "out"
    assert frontier.main(["--results", str(results), "--steps", str(steps), "--horizon", "100", "--out", str(out)]) == 0
    text = (out / "frontier.md").read_text()
    assert "whole tiny training step ms (eager / captured)" in text
    assert "| Muon | 0.01 | 0.8 | 3 | 0.7000 ± 0.0020 | — | 600.0 / 598.0 | 1.00 | 30.0 / 25.5 |" in text
    assert "| Dion3 3⁄8 by cost | 0.02 | 0.6 | 2 | 0.7015 ± 0.0007 | +0.0015 | 240.0 / 239.0 | 0.40 | — / 24.2 |" in text
    assert "| NorMuon | 0.02 | 0.6 | 2 | 0.6910 ± 0.0014 | -0.0090 | 601.0 / 600.0 | 1.00 | — / — |" in text
    assert "99.0" not in text


def test_a_batch_size_compares_the_runs_of_that_batch_alone(tmp_path):
    # the same settings at batch 16 and 128: --batch-size 128 tables the batch-128 losses only
    records = [record("muon", 0.02, 0.8, s, loss, batch_size=128) for s, loss in ((0, 0.61), (1, 0.612))]
    records += [record("dion3", 0.02, 0.6, s, loss, 0.375, "cost", batch_size=128) for s, loss in ((0, 0.614), (1, 0.616))]
    records += [record("muon", 0.02, 0.8, s, 0.70, batch_size=16) for s in (0, 1)]
    records += [record("dion3", 0.02, 0.6, s, 0.69, 0.375, "cost", batch_size=16) for s in (0, 1)]
    common, out = command_inputs(tmp_path, records)
    assert frontier.main(common + ["--horizon", "100", "--batch-size", "128", "--name", "frontier-b128"]) == 0
    text = (out / "frontier-b128.md").read_text()
    assert text.startswith("# Frontier at 100 steps, batch 128")
    assert "| Dion3 3⁄8 by cost | 0.02 | 0.6 | 2 | 0.6150 ± 0.0014 | +0.0040 |" in text
    assert "- muon quality: none measured within one seed sd of Muon's best" in text


def test_a_bench_row_times_the_rows_by_l2_but_not_weighted_rows():
    """Rows by L2 cost what the L1 rule costs (the same passes), so the rule's bench row times them;
    weighted rows are other fractions that spend another share of the budget, so it does not."""
    rule = frontier.Variant("dion3", 0.5, "cost")
    assert frontier._rounded(frontier.Variant("dion3", 0.5, "cost", row_score="l2")) == frontier._rounded(rule)
    weighted = frontier.Variant("dion3", 0.5, "cost", weights="gate_proj=2,up_proj=2")
    assert frontier._rounded(weighted) != frontier._rounded(rule)
