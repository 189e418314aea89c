"""One name per Dion3 setting: the old and other spellings read as the setting they mean, and
`dion3 compare`, `dion3 bench`, `dion3 fractions` and the quality study print the same name for
the same setting."""
from __future__ import annotations

import json
import random
from fractions import Fraction

import pytest

from dion3.tools.bench import step_time
from dion3.tools.cli import main as dion3_main
from dion3.tools.setting_names import Dion3Setting, canonical_name, fraction_text, parse_dion3
from dion3.tools.study import train_step
from dion3.tools.study.runs import Run
from dion3.tools.train import compare

# (spelling, the setting's name, fraction, allocation, warm-up steps)
SPELLINGS = [
    ("dion3-1/4", "dion3-1/4", 0.25, "uniform", 0),
    ("dion3-0.25", "dion3-1/4", 0.25, "uniform", 0),
    ("dion3-f0.25", "dion3-1/4", 0.25, "uniform", 0),  # `dion3 compare`'s old spelling
    ("dion3-f1/4", "dion3-1/4", 0.25, "uniform", 0),
    ("dion3-1/4-cost", "dion3-1/4-cost", 0.25, "cost", 0),
    ("dion3-f0.25-cost", "dion3-1/4-cost", 0.25, "cost", 0),
    ("dion3-0.375-cost", "dion3-3/8-cost", 0.375, "cost", 0),
    ("dion3-f0.5-cost", "dion3-1/2-cost", 0.5, "cost", 0),
    ("dion3-1/4-warmup200", "dion3-1/4-warmup200", 0.25, "uniform", 200),
    ("dion3-f0.25-warm200", "dion3-1/4-warmup200", 0.25, "uniform", 200),  # the old warm-up suffix
    ("dion3-f0.25-warmup50", "dion3-1/4-warmup50", 0.25, "uniform", 50),
    ("dion3-1/4-cost-warmup200", "dion3-1/4-cost-warmup200", 0.25, "cost", 200),  # the budget warms up
    ("dion3-0.5-cost-warmup8", "dion3-1/2-cost-warmup8", 0.5, "cost", 8),
    ("dion3-1/2-rows", "dion3-1/2-rows", 0.5, "most_rows", 0),  # the most rows within ½'s modeled time
    ("dion3-0.375-rows-warmup8", "dion3-3/8-rows-warmup8", 0.375, "most_rows", 8),
    ("dion3-1", "dion3-1", 1.0, "uniform", 0),
    ("dion3-1.0-cost", "dion3-1-cost", 1.0, "cost", 0),
    ("dion3-0.3", "dion3-3/10", 0.3, "uniform", 0),
    ("dion3-2/6", "dion3-1/3", 1 / 3, "uniform", 0),
    ("dion3-0.333", "dion3-0.333", 0.333, "uniform", 0),  # no small denominator: a decimal
]


@pytest.mark.parametrize("spelling, name, fraction, allocation, warmup", SPELLINGS)
def test_every_spelling_reads_as_its_setting(spelling, name, fraction, allocation, warmup):
    setting = parse_dion3(spelling)
    assert (setting.name, setting.allocation, setting.warmup_steps) == (name, allocation, warmup)
    assert setting.fraction == pytest.approx(fraction, rel=1e-15)
    assert canonical_name(spelling) == name and parse_dion3(name) == setting  # the name reads back as itself


@pytest.mark.parametrize("name", [
    "dion3-0", "dion3-3/2", "dion3-x", "dion3-", "dion3-cost", "dion3--cost", "dion3-1/4-costs", "dion3-1/4-cost-cost",
    "dion3-1/0", "dion3-f", "dion3-f-cost", "dion3-f0-cost", "dion3-1/4-warmup", "dion3-1/4-warmup0",
    "dion3-f0.25-warm", "dion3-1/4-warmupx", "dion3-1/4-warmup10-cost", "dion3-f0.25-warm10-cost",
    "dion3-1/2-rows-cost", "dion3-1/2-cost-rows", "dion3-1/2-warmup8-rows", "dion3-rows",
])
def test_names_that_spell_no_setting_are_refused(name):
    with pytest.raises(ValueError):
        parse_dion3(name)
    assert canonical_name(name) == name  # left as given, for the command's own error
    with pytest.raises(ValueError, match="--optimizers"):
        step_time.parse_variant(name)
    with pytest.raises(ValueError, match="--optimizers"):
        compare.run_spec(name, compare.PRESETS["cpu-tiny"], {}, {})


def test_other_names_are_not_dion3s():
    for name in ("adamw", "muon", "muon-gram", "normuon", "dion2-1/4", "dion3"):
        assert parse_dion3(name) is None and canonical_name(name) == name


def test_a_fraction_is_written_exactly_and_reads_back():
    """p/q where a denominator up to 64 is exact, else the decimal; either way the text reads back
    as the same float (checked against Fraction's own arithmetic)."""
    assert [fraction_text(f) for f in (0.5, 0.25, 0.125, 0.375, 1.0, 0.3, 1 / 3, 0.333, 5 / 64, 1 / 65)] == [
        "1/2", "1/4", "1/8", "3/8", "1", "3/10", "1/3", "0.333", "5/64", repr(1 / 65)]
    rng = random.Random(0)
    for _ in range(500):
        fraction = rng.choice([rng.random(), rng.randint(1, 64) / 64, Fraction(rng.randint(1, 40), 41)])
        fraction = float(fraction) or 0.5
        assert float(Fraction(fraction_text(fraction))) == fraction
        assert parse_dion3(Dion3Setting(fraction, "cost").name).fraction == fraction


def test_budgets_say_what_the_fraction_spends():
    assert Dion3Setting(0.25, "cost").budget == "1/4 by cost"
    assert Dion3Setting(0.5).budget == "1/2 on every matrix"
    assert Dion3Setting(0.25, warmup_steps=200).budget == "1 → 1/4 over 200 steps"
    assert Dion3Setting(0.25, "cost", 200).budget == "1 → 1/4 by cost over 200 steps"
    assert Dion3Setting(0.5, "most_rows").budget == "1/2 by cost, most rows"


def test_a_warmup_by_cost_is_trained_not_benched():
    """compare trains dion3-F-cost-warmupN (a FractionScheduler over the groups by cost); the bench,
    which prices fixed fractions by cost, refuses it and names the warm-up's end."""
    spec = compare.run_spec("dion3-1/4-cost-warmup200", compare.PRESETS["cpu-tiny"], {}, {})
    assert (spec.label, spec.fraction, spec.fraction_allocation, spec.fraction_warmup) == (
        "dion3-1/4-cost-warmup200", 0.25, "cost", 200)
    with pytest.raises(ValueError, match="bench the warm-up's end, dion3-1/4-cost, or train the warm-up"):
        step_time.parse_variant("dion3-1/4-cost-warmup200")


@pytest.mark.parametrize("spelling", ["dion3-0.375-cost", "dion3-f0.375-cost", "dion3-3/8-cost"])
def test_one_setting_is_named_alike_by_every_command(spelling, tmp_path, capsys):
    """However the setting is spelled, compare's run, bench's row (table, JSON), the fractions
    command's heading, train_step's row and the study's run label all call it dion3-3/8-cost."""
    name = "dion3-3/8-cost"
    spec = compare.run_spec(canonical_name(spelling), compare.PRESETS["cpu-tiny"], {}, {})
    assert (spec.label, spec.fraction, spec.fraction_allocation) == (name, 0.375, "cost")
    assert train_step.run_spec(spelling).label == name

    path = tmp_path / "bench.json"
    assert dion3_main(["bench", "--device", "cpu", "--shapes", "16x16:2,8x16", "--optimizers", f"muon,{spelling}",
                       "--steps", "1", "--warmup", "1", "--json", str(path)]) == 0
    printed = capsys.readouterr()
    rows = json.loads(path.read_text())["results"]
    assert [row["name"] for row in rows] == ["muon", name] and "error" not in rows[1]
    assert any(line.startswith(f"{name} ") for line in printed.out.splitlines())
    assert (f"note: {spelling} is written {name}" in printed.err) == (spelling != name)

    for fraction in ("0.375", "3/8"):
        assert dion3_main(["fractions", "--shapes", "16x16:2,8x16", "--fraction", fraction]) == 0
        heading = capsys.readouterr().out.splitlines()[0]
        assert f": {name}, fractions per matrix shape within the modeled H200 step time of 3/8 on every matrix" in heading

    run = Run(model="gpt-tiny", optimizer="dion3", lr=0.02, mu=0.6, fraction=0.375, fraction_warmup=0, horizon=100,
              seed=0, batch_size=4, lr_warmup=0, cooldown=0.4, eval_batches=1, data=None,
              fraction_allocation="cost", cost_rule="time")
    assert run.label.startswith(f"{name} lr=")


def test_compare_and_bench_default_lists_name_the_recommended_settings_alike():
    bench = {v.name for v in map(step_time.parse_variant, step_time.DEFAULT_OPTIMIZERS.split(","))}
    assert {"dion3-1/2-cost", "dion3-1/4-cost"} <= bench
    assert set(compare.DEFAULT_OPTIMIZERS) - {"adamw", "muon", "normuon"} == {"dion3-1/2-cost", "dion3-1/4-cost"}
    assert all(canonical_name(name) == name for name in compare.DEFAULT_OPTIMIZERS)
    for preset in compare.PRESETS.values():  # the presets' lr and μ are keyed by the same names
        assert all(canonical_name(name) == name for name in (*preset.lrs, *preset.mus))
