"""dion3.tools.study.regime: the parameter count the tokens per parameter divide by (against the
models the study builds), the gap to Muon paired by seed (worked out by hand), and regimes kept
apart by batch size (a larger batch's better loss never becomes the smaller batch's best)."""
from __future__ import annotations

import math

import pytest
import torch

from dion3.tools.study import frontier, regime
from dion3.tools.study.runs import MODELS


def record(model, batch, optimizer, lr, mu, seed, loss, fraction=None, horizon=1500):
    config = dict(model=model, optimizer=optimizer, lr=lr, mu=mu, fraction=fraction, fraction_warmup=0, horizon=horizon,
                  seed=seed, batch_size=batch, compiled=True, momentum_dtype=None,
                  fraction_allocation="cost" if fraction else "uniform", cost_rule="time" if fraction else None)
    return {"config": config, "seed": seed, "final_val_loss": loss}


def hidden_matrix_count(model: torch.nn.Module) -> int:
    """2-D weights inside the blocks: every matrix but the embedding and the head."""
    return sum(p.numel() for name, p in model.named_parameters()
               if p.ndim == 2 and "embed" not in name and "lm_head" not in name)


@pytest.mark.parametrize("name", ["llama-384", "llama-hf", "llama-hf-110m"])
def test_block_matrix_parameters_count_the_study_models_hidden_matrices(name):
    pytest.importorskip("transformers")
    from dion3.tools.study.child import build_llama
    from dion3.tools.train.model import GPTConfig

    spec = MODELS[name]
    with torch.device("meta"):  # the shapes alone
        model = build_llama(spec)(GPTConfig(vocab_size=256, seq_len=spec.seq_len))
    assert regime.block_matrix_parameters(spec) == hidden_matrix_count(model)


def test_block_matrix_parameters_of_the_gpt_models():
    from dion3.tools.train.model import GPT, GPTConfig

    spec = MODELS["gpt-tiny"]
    model = GPT(GPTConfig(vocab_size=256, seq_len=spec.seq_len, n_layer=spec.n_layer, n_head=spec.n_head,
                          d_model=spec.d_model))
    assert regime.block_matrix_parameters(spec) == hidden_matrix_count(model) == 2 * 12 * 64 * 64


def test_regime_tokens():
    g = regime.Regime("llama-384", 128, 1500)
    assert g.tokens_per_step == 128 * 512
    # llama-384: 12 layers of q, o (384²), k, v (384 × 128) and three 384 × 1024 MLP matrices
    params = 12 * (2 * 384 * 384 + 2 * 384 * 128 + 3 * 384 * 1024)
    assert g.tokens_per_parameter == pytest.approx(128 * 512 * 1500 / params)


def test_gap_is_paired_by_seed_where_two_seeds_are_shared():
    muon = frontier.Point(frontier.Variant("muon"), 0.01, 0.8, [0.700, 0.710, 0.705], {}, seeds=[0, 1, 2])
    dion = frontier.Point(frontier.Variant("dion3", 0.5, "cost"), 0.02, 0.6, [0.702, 0.713, 0.706], {}, seeds=[0, 1, 2])
    g = regime.gap(dion, muon)
    # differences 0.002, 0.003, 0.001: mean 0.002, sd 0.001; Muon's sd 0.005 → within
    assert g.mean == pytest.approx(0.002) and g.sd == pytest.approx(0.001) and g.paired == 3
    assert g.muon_sd == pytest.approx(0.005) and g.within
    lone = frontier.Point(frontier.Variant("normuon"), 0.02, 0.6, [0.720, 0.724], {}, seeds=[5, 6])
    g = regime.gap(lone, muon)  # no shared seed: the spreads combined
    assert g.paired == 0 and g.sd == pytest.approx(math.sqrt(0.004 ** 2 / 2 + 0.005 ** 2))  # 0.0057
    assert lone.sd == pytest.approx(0.0028284, abs=1e-6) and g.mean == pytest.approx(0.017) and not g.within


RECORDS = (
    # batch 32: Muon 0.70 ± 0.01 (seeds 0–2), Dion3 ½ by cost 0.715 ± 0.005 → +0.015, outside
    [record("llama-384", 32, "muon", 0.01, 0.8, s, loss) for s, loss in enumerate([0.69, 0.70, 0.71])]
    + [record("llama-384", 32, "dion3", 0.015, 0.6, s, loss, 0.5) for s, loss in enumerate([0.71, 0.715, 0.72])]
    # batch 128: lower losses, Muon best at lr 0.02 (lr 0.01 worse), Dion3 ½ within
    + [record("llama-384", 128, "muon", 0.02, 0.8, s, loss) for s, loss in enumerate([0.60, 0.61, 0.62])]
    + [record("llama-384", 128, "muon", 0.01, 0.8, 0, 0.65)]
    + [record("llama-384", 128, "dion3", 0.03, 0.6, s, loss, 0.5) for s, loss in enumerate([0.605, 0.612, 0.619])]
    # one seed only: shown with --min-seeds 1 alone
    + [record("llama-384", 128, "normuon", 0.02, 0.6, 0, 0.59)]
)


def test_regimes_keep_batch_sizes_apart():
    table = regime.regime_gaps(RECORDS)
    small, large = regime.Regime("llama-384", 32, 1500), regime.Regime("llama-384", 128, 1500)
    assert list(table) == [small, large]
    assert table[small].muon.mean == pytest.approx(0.70) and table[small].muon.lr == 0.01
    assert table[large].muon.mean == pytest.approx(0.61) and table[large].muon.lr == 0.02
    half = frontier.Variant("dion3", 0.5, "cost")
    point, g = table[small].gaps[half]
    assert (point.lr, g.paired) == (0.015, 3) and g.mean == pytest.approx(0.015) and not g.within
    point, g = table[large].gaps[half]
    assert point.lr == 0.03 and g.mean == pytest.approx(0.002) and g.within
    assert frontier.Variant("normuon") not in table[large].gaps  # one seed
    assert frontier.Variant("normuon") in regime.regime_gaps(RECORDS, min_seeds=1)[large].gaps
    # the frontier itself reads the model's own batch (32 for llama-384) unless told otherwise
    assert frontier.best_points(RECORDS, "llama-384", 1500, True)[frontier.Variant("muon")].mean == pytest.approx(0.70)


def test_another_schedules_muon_is_a_row_against_the_default_muon():
    four = [record("llama-384", 32, "muon", 0.01, 0.8, s, 0.69 + s / 1000) for s in (0, 1, 2)]
    for r in four:
        r["config"]["ns_coefficients"] = "polar_express_4"
    table = regime.regime_gaps(RECORDS + four)
    row = table[regime.Regime("llama-384", 32, 1500)]
    muon4 = frontier.Variant("muon", ns_coefficients="polar_express_4")
    assert row.muon.variant == frontier.Variant("muon") and row.muon.mean == pytest.approx(0.70)
    assert row.gaps[muon4][1].mean == pytest.approx(-0.009)
    text = regime.regime_table(table)
    assert text.index("| Muon, 4 NS steps |") < text.index("| Dion3 1⁄2 by cost |")  # Muon's own rows first


def test_main_writes_the_table_and_the_picture(tmp_path):
    import json

    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS))
    assert regime.main(["--results", str(path), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "regime.md").read_text()
    assert "llama-384, 128 × 512, 1500 steps" in text and "+0.0020 ± 0.0030 (within" in text
    assert "+0.0150 ± 0.0050 (outside" in text
    assert (tmp_path / "out" / "regime.png").stat().st_size > 0


def test_each_regime_names_the_cards_of_its_runs():
    records = [dict(r) for r in RECORDS]
    for r in [r for r in records if r["config"]["batch_size"] == 128][:2]:
        r["card"] = "NVIDIA H100 80GB HBM3"
    text = regime.regime_cards(records, regime.Regime("llama-384", 128, 1500))
    assert text == "not recorded × 6, NVIDIA H100 80GB HBM3 × 2"  # eight runs at batch 128, most first
    assert regime.regime_cards(records, regime.Regime("llama-384", 32, 1500)) == "not recorded × 6"
    assert regime.regime_cards(records, regime.Regime("llama-384", 16, 1500)) == ""


def test_a_larger_batch_is_its_own_setting_in_the_summary():
    from dion3.tools.study.summary import summary_table

    rows = [dict(r, average_fraction=1.0, optimizer_ms_median=1.0,
                 config=dict(r["config"], eval_batches=16, data=None, lr_warmup=50, cooldown=0.3))
            for r in RECORDS if r["config"]["optimizer"] == "muon"]
    lines = [line for line in summary_table(rows).splitlines() if "| 1500 | Muon |" in line]
    # llama-384's own batch is 32: its rows say nothing of it; batch 128's rows say so, apart
    assert sorted(line.split(" | ")[0] for line in lines) == [
        "| llama-384 (compiled)", "| llama-384 (compiled, batch 128)", "| llama-384 (compiled, batch 128)"]
    assert sum(" 0.01 | 0.8 | 3 |" in line for line in lines) == 1  # batch 32's three seeds, not batch 128's one


@pytest.mark.parametrize("count", [1, 10, 11, 20, 33])
def test_every_setting_gets_its_own_colour(count):
    # the screened variants pushed the pictures past ten settings: a ten-colour cycle repeated (regime)
    # or ran out (efficiency)
    from dion3.tools.study.colours import distinct_colours

    colours = distinct_colours(count)
    assert len(colours) == count and len({tuple(round(c, 6) for c in colour) for colour in colours}) == count
