"""Step-efficiency (the study's e_S) and the time to Muon's loss that `dion3 plan` predicts from it,
on hand-worked cases: curves whose crossings fall on round numbers in log steps."""
from __future__ import annotations

import json
import math

import pytest

from dion3.tools.plan.time_to_loss import (DATA, Efficiency, MeasuredRegime, Run, forward_backward_seconds,
                                           load_efficiencies, nearest_regime, other_shapes, predict, recommendation,
                                           report, shape_check)
from dion3.tools.study.efficiency import regime_efficiencies, steps_to_loss, write_data


def test_steps_to_loss_is_linear_in_log_steps_between_horizons():
    curve = [(1000, 1.0), (4000, 0.8)]
    steps, outside = steps_to_loss(curve, 0.9)  # halfway in loss: halfway in log steps, √(1000·4000)
    assert steps == pytest.approx(2000.0) and not outside
    assert steps_to_loss(curve, 1.0) == (pytest.approx(1000.0), False)


def test_steps_to_loss_extends_the_end_segments_and_says_so():
    curve = [(1000, 1.0), (4000, 0.8), (16000, 0.7)]
    steps, outside = steps_to_loss(curve, 0.65)  # half a segment past the last: 16000 · 4^0.5
    assert steps == pytest.approx(32000.0) and outside
    steps, outside = steps_to_loss(curve, 1.1)  # half a segment before the first: 1000 / 4^0.5
    assert steps == pytest.approx(500.0) and outside


def test_steps_to_loss_refuses_a_curve_that_does_not_fall():
    with pytest.raises(ValueError, match="does not fall"):
        steps_to_loss([(1000, 1.0), (2000, 1.1)], 1.05)


def _record(optimizer, horizon, seed, loss, fraction=None, lr=0.02, mu=0.8):
    config = dict(model="llama-384", optimizer=optimizer, lr=lr, mu=mu, fraction=fraction, fraction_warmup=0,
                  horizon=horizon, seed=seed, batch_size=128, compiled=True, momentum_dtype=None,
                  fraction_allocation="cost" if fraction else "uniform", cost_rule="time" if fraction else None,
                  row_score="l1", fraction_weights=None, ns_coefficients="polar_express")
    return dict(config=config, seed=seed, horizon=horizon, final_val_loss=loss, card="test card")


def test_regime_efficiency_reads_the_setting_loss_on_muons_mean_curve():
    # Muon: mean 1.01 at 1000 steps, 0.81 at 4000; ½ by cost at 4000: 0.91 on both seeds (paired
    # differences both 0.10, so no spread): Muon reaches 0.91 at √(1000·4000) = 2000 steps, e = 0.5
    records = [_record("muon", 1000, 0, 1.00), _record("muon", 1000, 1, 1.02),
               _record("muon", 4000, 0, 0.80), _record("muon", 4000, 1, 0.82),
               _record("dion3", 4000, 0, 0.90, fraction=0.5, mu=0.6), _record("dion3", 4000, 1, 0.92, fraction=0.5, mu=0.6),
               _record("adamw", 4000, 0, 2.0, mu=0.0)]
    rows = regime_efficiencies(records)
    assert [r.setting for r in rows] == ["dion3-1/2-cost"]  # neither Muon itself nor AdamW
    row = rows[0]
    assert row.efficiency == pytest.approx(0.5) and row.low == pytest.approx(0.5) and row.high == pytest.approx(0.5)
    assert row.seeds == 2 and row.muon_horizons == ((1000, 2), (4000, 2)) and not row.extrapolated
    assert row.tokens_per_step == 128 * 512 and row.cards == "test card × 5"
    assert row.row_share == 0.519  # llama-384's ½ by cost: its landed runs record average_fraction 0.5185


def test_regime_efficiency_band_is_the_paired_gap_spread():
    # paired gaps 0.08 and 0.12 (sd 0.02√2): the band reads the curve at 0.91 ± 0.0283
    records = [_record("muon", 1000, s, 1.01) for s in (0, 1)] + [_record("muon", 4000, s, 0.81) for s in (0, 1)]
    records += [_record("normuon", 4000, 0, 0.89, mu=0.6), _record("normuon", 4000, 1, 0.93, mu=0.6)]
    row, = regime_efficiencies(records)
    sd = math.sqrt(2) * 0.02
    assert row.efficiency == pytest.approx(0.5, abs=1e-4)
    assert row.low == pytest.approx(4 ** (0.5 - sd / 0.2) * 1000 / 4000, abs=1e-4)  # a higher loss: fewer Muon steps
    assert row.high == pytest.approx(4 ** (0.5 + sd / 0.2) * 1000 / 4000, abs=1e-4)


def test_a_model_with_one_muon_horizon_has_no_efficiency():
    records = [_record("muon", 1500, 0, 1.0), _record("dion3", 1500, 0, 1.01, fraction=0.25, mu=0.6)]
    assert regime_efficiencies(records) == []


def test_the_data_file_round_trips_into_the_plan(tmp_path):
    records = [_record("muon", h, s, loss) for h, loss in ((1000, 1.01), (4000, 0.81)) for s in (0, 1)]
    records += [_record("dion3", 4000, s, 0.91, fraction=0.25, mu=0.6) for s in (0, 1)]
    path = tmp_path / "efficiency.json"
    write_data(regime_efficiencies(records), path, "the command")
    table = load_efficiencies(path)
    (regime, row), = table.items()
    assert regime.model == "llama-384" and regime.horizon == 4000 and regime.tokens_per_step == 65536
    assert row["dion3-1/4-cost"] == Efficiency(0.5, 0.5, 0.5, 2)
    assert json.loads(path.read_text())["command"] == "the command"


def test_the_packaged_data_file_holds_every_setting_the_plan_compares():
    table = load_efficiencies(DATA)
    assert any({"normuon", "dion3-1/4-cost", "dion3-3/8-cost", "dion3-1/2-cost"} <= set(row) for row in table.values())
    for row in table.values():
        for e in row.values():
            assert 0 < e.low <= e.value <= e.high


def _regime(tokens_per_step, tokens_per_parameter, horizon=1500):
    return MeasuredRegime("m", 10**6, tokens_per_step, horizon, tokens_per_parameter)


def test_nearest_regime_adds_the_log_distances_of_both_axes():
    complete = {"dion3-1/4-cost": Efficiency(0.9, 0.8, 1.0, 3)}
    small, large = _regime(8192, 0.5), _regime(65536, 10.0)
    table = {small: complete, large: complete}
    assert nearest_regime(table, 8192, 1.0, ["dion3-1/4-cost"]) == small
    assert nearest_regime(table, 4_000_000, 20.0, ["dion3-1/4-cost"]) == large
    # 16 k tokens a step at 5 tokens per parameter: ln 2 + ln 10 ≈ 3.0 from small, ln 4 + ln 2 ≈ 2.1 from large
    assert nearest_regime(table, 16384, 5.0, ["dion3-1/4-cost"]) == large


def test_nearest_regime_prefers_regimes_that_measured_every_setting():
    near, far = _regime(8192, 1.0), _regime(65536, 10.0)
    table = {near: {"dion3-1/4-cost": Efficiency(0.9, 0.8, 1.0, 3)},
             far: {"dion3-1/4-cost": Efficiency(0.9, 0.8, 1.0, 3), "dion3-1/2-cost": Efficiency(0.95, 0.9, 1.0, 3)}}
    assert nearest_regime(table, 8192, 1.0, ["dion3-1/4-cost", "dion3-1/2-cost"]) == far


def test_forward_backward_is_six_flops_per_parameter_and_token_over_the_world():
    # 1 B parameters, 1 M tokens, 8 ranks at 500 TFLOP/s: 6e15 / 4e15 = 1.5 s
    assert forward_backward_seconds(1e9, 2**20, 8, 500e12) == pytest.approx(6 * 1e9 * 2**20 / (8 * 500e12))


def test_a_cheap_step_wins_where_the_optimizer_is_a_large_share():
    # forward/backward 0.1 s, Muon's optimizer 0.05 s, ¼ by cost's 0.0125 s at e = 0.9:
    # whole steps 0.15 and 0.1125 (0.75×), time to Muon's loss 0.75 / 0.9 = 0.833×
    efficiencies = {"normuon": Efficiency(1.0, 0.98, 1.02, 3), "dion3-1/4-cost": Efficiency(0.9, 0.88, 0.92, 3)}
    predictions = predict({"muon": 0.05, "normuon": 0.05, "dion3-1/4-cost": 0.0125}, 0.1, efficiencies)
    quarter = predictions[2]
    assert quarter.step_ratio == pytest.approx(0.75) and quarter.time_ratio == pytest.approx(0.75 / 0.9)
    assert quarter.time_low == pytest.approx(0.75 / 0.92) and quarter.time_high == pytest.approx(0.75 / 0.88)
    line = recommendation(predictions)
    assert line.startswith("recommend dion3-1/4-cost: 0.833×") and "outside the measurement's band" in line


def test_muon_wins_where_the_optimizer_is_negligible():
    # forward/backward 10 s: ¼'s whole step is 0.9963× Muon's, over e = 0.9: 1.107×
    efficiencies = {"normuon": Efficiency(1.0, 0.98, 1.02, 3), "dion3-1/4-cost": Efficiency(0.9, 0.88, 0.92, 3)}
    predictions = predict({"muon": 0.05, "normuon": 0.05, "dion3-1/4-cost": 0.0125}, 10.0, efficiencies)
    assert predictions[2].time_ratio == pytest.approx((10.0125 / 10.05) / 0.9)
    line = recommendation(predictions)
    assert line.startswith("recommend muon: 1.000×") and "no Dion3 setting gets there sooner" in line
    assert "within the measurement's band: normuon 1.000×" in line  # NorMuon's band holds Muon's time


def test_a_setting_not_measured_in_the_regime_is_left_out_of_the_advice():
    predictions = predict({"muon": 0.05, "dion3-1/2-cost": 0.02}, 0.1, {})
    assert predictions[1].efficiency is None and predictions[1].time_ratio is None
    assert recommendation(predictions).startswith("recommend muon")


def test_other_shapes_are_the_same_tokens_a_step_on_another_model_nearest_in_tokens_per_parameter():
    def regime(model, tokens_per_step, tokens_per_parameter):
        return MeasuredRegime(model, 10**6, tokens_per_step, 1500, tokens_per_parameter)

    base = regime("a", 65536, 5.0)
    near, nearer, other_batch, too_long = (regime("b", 65536, 7.0), regime("b", 65536, 5.5), regime("c", 8192, 5.0),
                                           regime("d", 65536, 7.6))  # 7.6 / 5 > 1.5
    same_model = regime("a", 65536, 5.5)
    table = {g: {} for g in (base, near, nearer, other_batch, too_long, same_model)}
    assert other_shapes(table, base) == [nearer]


def test_a_shape_check_divides_the_same_whole_steps_by_the_other_shapes_efficiencies():
    # forward/backward 0.1 s, Muon's optimizer 0.05 s, ½'s 0.02 (whole 0.8×): e 0.9 here, 0.8 on the
    # other shape, so 0.889× here and 1.0× there; a setting the other shape did not measure is left out
    predictions = predict({"muon": 0.05, "dion3-1/2-cost": 0.02, "dion3-1/4-cost": 0.01}, 0.1,
                          {"dion3-1/2-cost": Efficiency(0.9, 0.88, 0.92, 3), "dion3-1/4-cost": Efficiency(0.8, 0.7, 0.9, 3)})
    times = shape_check(predictions, {"dion3-1/2-cost": Efficiency(0.8, 0.78, 0.82, 2)})
    assert times == {"dion3-1/2-cost": pytest.approx(0.8 / 0.8)}
    other = MeasuredRegime("held-out", 2 * 10**6, 65536, 1500, 5.0)
    text = report(Run(65536, 1, 1e8, 1e8, 5.0, False, 350e12), other, 0.1, predictions, {},
                  [(other, {"dion3-1/2-cost": Efficiency(0.8, 0.78, 0.82, 2)})])
    assert "another shape, held-out (2 M hidden parameters)" in text and "dion3-1/2-cost e 0.800 (2 seeds) → 1.000×" in text


def test_a_settings_row_share_is_the_average_fraction_its_landed_runs_recorded():
    # the study's runs record the share of the rows their optimizer selected (from the real model's
    # param_groups); the plan's row_share reads the same share from the preset's shapes alone
    from pathlib import Path

    from dion3.tools.bench.presets import named_model
    from dion3.tools.plan.fractions import row_share

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    lines = [line for name in ("frontier", "quality-study-llama-hf", "quality-study-llama-384")
             for line in (results / name / "results.jsonl").read_text().splitlines()]
    recorded: dict[tuple[str, float, str], set[float]] = {}
    for line in lines:
        record = json.loads(line)
        c = record["config"]
        by_time = c.get("fraction_allocation", "uniform") == "uniform" or c.get("cost_rule") == "time"
        if (c["optimizer"] == "dion3" and c.get("fraction_warmup") == 0 and by_time
                and c.get("ns_coefficients") in (None, "polar_express")
                and not c.get("fraction_weights") and not c.get("full_every") and "average_fraction" in record):
            key = (c["model"], c["fraction"], c.get("fraction_allocation", "uniform"))
            recorded.setdefault(key, set()).add(round(record["average_fraction"], 9))
    assert {("llama-384", 0.5, "cost"), ("llama-384", 0.375, "cost"), ("llama-512-6l", 0.5, "cost"),
            ("llama-512-6l", 0.375, "cost"), ("llama-hf", 0.25, "uniform")} <= set(recorded)
    for (model, fraction, allocation), shares in recorded.items():
        described = named_model(model, None, None, "plan")
        expected = row_share(described.preset.matrices, fraction, described.experts, allocation)
        assert all(share == pytest.approx(expected, abs=1e-9) for share in shares), (model, fraction, shares, expected)


def test_every_row_selected_is_a_share_of_one():
    from dion3.tools.bench.presets import named_model
    from dion3.tools.plan.fractions import row_share

    described = named_model("llama-1b", None, None, "plan")
    assert row_share(described.preset.matrices, 1.0) == 1.0


def test_the_report_says_where_a_setting_selects_fewer_rows_than_where_it_was_measured():
    predictions = predict({"muon": 0.05, "dion3-1/2-cost": 0.02, "dion3-3/8-cost": 0.015}, 0.1,
                          {"dion3-1/2-cost": Efficiency(0.9, 0.88, 0.92, 3), "dion3-3/8-cost": Efficiency(0.9, 0.88, 0.92, 3)})
    regime = MeasuredRegime("study", 10**6, 65536, 1500, 5.0)
    run = Run(65536, 1, 1e8, 1e8, 5.0, False, 350e12)
    # ½: 0.40 here against 0.52 (0.12 fewer: said); ⅜: 0.46 against 0.48 (within 0.05: not)
    text = report(run, regime, 0.1, predictions, {}, (), {"dion3-1/2-cost": (0.40, 0.52), "dion3-3/8-cost": (0.46, 0.48)})
    assert "| 0.40 / 0.52 |" in text and "| 0.46 / 0.48 |" in text
    fewer = [line for line in text.splitlines() if line.startswith("fewer rows")]
    assert len(fewer) == 1 and "dion3-1/2-cost 0.40 against 0.52" in fewer[0] and "3/8" not in fewer[0]
    assert not any(line.startswith("fewer rows") for line in report(run, regime, 0.1, predictions, {}).splitlines())


def test_the_readme_gives_each_by_cost_setting_the_share_of_rows_it_selects():
    import re
    from pathlib import Path

    from dion3.tools.bench.presets import named_model
    from dion3.tools.plan.fractions import row_share

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    fractions = {"½": 0.5, "⅜": 0.375, "¼": 0.25}
    rows = re.findall(r"^\| Dion3 ([½⅜¼]) by cost \(0\.02, 0\.6\) \| [^|]+ \| ([\d.]+) / ([\d.]+) / ([\d.]+) \|", readme,
                      re.MULTILINE)
    assert len(rows) == 3
    for symbol, *shares in rows:
        for model, written in zip(("llama-hf", "llama-384", "llama-8b"), shares):
            matrices = named_model(model, None, None, "plan").preset.matrices
            assert float(written) == round(row_share(matrices, fractions[symbol]), 2), (symbol, model)


def test_a_setting_joins_the_advice_once_measured_on_three_seeds():
    from dion3.tools.plan.time_to_loss import SETTINGS, advised_settings

    measured = {"dion3-1/2-cost": Efficiency(0.93, 0.92, 0.94, 3),
                "dion3-1/2-rows": Efficiency(0.99, 0.98, 1.0, 3),  # a kept variant: joins
                "dion3-3/8-rows": Efficiency(0.99, 0.98, 1.0, 1),  # one seed: not yet
                "dion3-1/4": Efficiency(0.84, 0.80, 0.88, 3),  # uniform ¼, measured: joins
                "dion3-1/2-cost-warmup8": Efficiency(0.9, 0.9, 0.9, 3),  # a warm-up: the plan prices fixed fractions
                "Dion3 1⁄2 by cost, 4 NS steps": Efficiency(0.91, 0.90, 0.92, 3)}  # a label, no setting name
    assert advised_settings(measured) == [*SETTINGS, "dion3-1/2-rows", "dion3-1/4"]


def test_the_shares_the_docs_quote_for_the_most_rows():
    """training.md, param_groups and the frontier README quote these shares of the rows at ½'s and
    ⅜'s budget: Llama-8B 0.64 (most rows) against 0.42 (by cost), llama-384 0.78 against 0.52; ⅜
    0.44 against 0.39 and 0.68 against 0.48."""
    from dion3.tools.bench.presets import named_model
    from dion3.tools.plan.fractions import row_share

    quoted = {("llama-8b", 0.5): (0.64, 0.42), ("llama-384", 0.5): (0.78, 0.52),
              ("llama-8b", 0.375): (0.44, 0.39), ("llama-384", 0.375): (0.68, 0.48)}
    for (model, fraction), (most, by_cost) in quoted.items():
        matrices = named_model(model, None, None, "plan").preset.matrices
        assert round(row_share(matrices, fraction, allocation="most_rows"), 2) == most, (model, fraction)
        assert round(row_share(matrices, fraction, allocation="cost"), 2) == by_cost, (model, fraction)
