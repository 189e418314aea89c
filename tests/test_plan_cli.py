"""`dion3 plan` end to end on the fake process group: JSON output of a small preset, and a world
of 1024 ranks (FSDP2 + TP) planned on this CPU."""
from __future__ import annotations

import json

from dion3.tools.plan import cli


def test_json_accounts_for_every_matrix_and_byte(tmp_path):
    out = tmp_path / "plan.json"
    assert cli.main(["--preset", "llama-1b", "--layout", "fsdp=4", "--optimizers", "muon,dion3",
                     "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["world_size"] == 4
    for entry in data["optimizers"]:
        ranks = entry["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
        assert sum(r["owned"] for r in ranks) == 16 * 7  # every matrix of 16 layers has one owner
        # fp32 parameters split over 4 ranks: 0.97 B matrix parameters in all
        total = sum(r["memory_gb"]["params"] for r in ranks) * 1e9
        assert abs(total - 4 * (16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 8192 * 2048))) < 1e3
        # an all-to-all: what all ranks send, all ranks receive
        sent = sum(sum(r["sent_mb"].values()) for r in ranks)
        assert abs(sent - sum(sum(r["received_mb"].values()) for r in ranks)) < 1e-6


def test_a_world_of_1024_ranks_plans(capsys):
    assert cli.main(["--shapes", "4096x4096:8,1024x4096:8", "--layout", "fsdp=128,tp=8", "--optimizers", "dion3",
                     "--json", "-", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    ranks = data["optimizers"][0]["ranks"]
    assert len(ranks) == 1024 and sum(r["owned"] for r in ranks) == 16


def _efficiencies(tmp_path, rows):
    """A data file as the study writes it, with the given (setting, e, low, high) rows in one regime."""
    path = tmp_path / "efficiency.json"
    regime = dict(model="llama-384", parameters=18874368, batch_size=128, tokens_per_step=65536, horizon=1500,
                  tokens_per_parameter=5.2, label="", seeds=3, muon_horizons=[[1000, 3], [2000, 3]],
                  extrapolated=False, cards="test card × 9")
    path.write_text(json.dumps(dict(command="test", rows=[dict(regime, setting=s, efficiency=e, low=lo, high=hi)
                                                            for s, e, lo, hi in rows])))
    return str(path)


EFFICIENCIES = [("normuon", 1.0, 0.99, 1.01), ("dion3-1/4-cost", 0.85, 0.84, 0.86),
                ("dion3-3/8-cost", 0.92, 0.91, 0.93), ("dion3-1/2-cost", 0.93, 0.92, 0.94)]


def _advice(argv, capsys) -> dict:
    assert cli.main(argv + ["--json", "-", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)["time_to_loss"]


def test_the_advice_flips_with_the_optimizers_share_of_the_step(tmp_path, capsys):
    """Llama-1B on one GPU at 8 k tokens a step: a forward and backward of 6 · 1.24 B · 8192 / 350
    TFLOP/s = 174 ms beside Muon's planned optimizer step of about 43 ms, so a step at 0.45× Muon's
    optimizer is about 0.89× Muon's whole step, and at e = 0.92 gets to Muon's loss sooner.
    Llama-8B on 8 GPUs at 4 M tokens a step: 67 s a step, the optimizer under 0.2%, so every
    setting's whole step is Muon's and e < 1 makes each slower."""
    data = _efficiencies(tmp_path, EFFICIENCIES)
    small = _advice(["--preset", "llama-1b", "--layout", "single", "--tokens-per-step", "8192", "--efficiency", data], capsys)
    parameters = 16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 8192 * 2048) + 128256 * 2048  # matrices and the tied head
    assert small["run"]["parameters"] == parameters
    assert abs(small["forward_backward_s"] - 6 * parameters * 8192 / 350e12) < 1e-12
    by_setting = {p["setting"]: p for p in small["predictions"]}
    muon = by_setting["muon"]
    for name, e, low, high in EFFICIENCIES:  # each time is its whole-step ratio over its efficiency
        p = by_setting[name]
        ratio = (small["forward_backward_s"] + p["optimizer_s"]) / (small["forward_backward_s"] + muon["optimizer_s"])
        assert abs(p["step_ratio"] - ratio) < 1e-12 and abs(p["time_ratio"] - ratio / e) < 1e-12
    best = min(by_setting.values(), key=lambda p: p["time_ratio"] if p["time_ratio"] is not None else 9)
    assert best["setting"].startswith("dion3-") and best["time_ratio"] < 1
    assert small["recommendation"].startswith(f"recommend {best['setting']}:")

    large = _advice(["--preset", "llama-8b", "--layout", "fsdp=8", "--tokens-per-step", "4194304", "--efficiency", data],
                    capsys)
    assert all(abs(p["step_ratio"] - 1) < 0.002 for p in large["predictions"])
    assert large["recommendation"].startswith("recommend muon:")
    assert "within the measurement's band: normuon" in large["recommendation"]


def test_the_shipped_efficiencies_answer_both_runs_and_name_their_regime(capsys):
    """The acceptance runs, on the measured step-efficiencies dion3 ships (a new measurement that
    changes an answer fails here: then the docs' advice changes with it)."""
    assert cli.main(["--preset", "llama-1b", "--layout", "single", "--tokens-per-step", "8192", "--quiet", "--ranks", "0"]) == 0
    out = capsys.readouterr().out
    assert "step-efficiency from the measured regime nearest this run: llama-384" in out
    assert out.strip().splitlines()[-1].startswith("recommend dion3-")
    assert cli.main(["--preset", "llama-8b", "--layout", "fsdp=8", "--tokens-per-step", "4194304", "--quiet",
                     "--ranks", "0"]) == 0
    out = capsys.readouterr().out
    assert "step-efficiency from the measured regime nearest this run: llama-384" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("recommend muon:") or last.startswith("recommend normuon:")


def test_tokens_per_parameter_picks_the_regime(tmp_path, capsys):
    rows = [dict(model="llama-384", parameters=18874368, batch_size=b, tokens_per_step=t, horizon=h, tokens_per_parameter=tpp,
                 setting="dion3-1/4-cost", label="", efficiency=e, low=e, high=e, seeds=3, muon_horizons=[],
                 extrapolated=False, cards="") for b, t, h, tpp, e in ((16, 8192, 1500, 0.65, 1.1), (128, 65536, 3000, 10.4, 0.8))]
    path = tmp_path / "two.json"
    path.write_text(json.dumps(dict(rows=rows)))
    base = ["--preset", "llama-1b", "--layout", "single", "--tokens-per-step", "8192", "--efficiency", str(path)]
    assert _advice(base + ["--train-tokens", str(0.6 * 0.973e9)], capsys)["regime"]["horizon"] == 1500
    assert _advice(base + ["--train-tokens", str(20 * 0.973e9)], capsys)["regime"]["horizon"] == 3000


def test_bad_time_to_loss_inputs_are_refused_by_name(tmp_path, capsys):
    base = ["--preset", "llama-1b", "--layout", "single", "--quiet"]
    cases = [(["--tokens-per-step", "0"], "--tokens-per-step must be positive"),
             (["--tokens-per-step", "8192", "--train-tflops", "-1"], "--train-tflops must be positive"),
             (["--tokens-per-step", "8192", "--efficiency", str(tmp_path / "missing.json")],
              "--efficiency: cannot read step-efficiencies"),
             (["--shapes", "256x512:4", "--experts", "8", "--tokens-per-step", "8192"], "needs --parameters")]
    for extra, message in cases:
        assert cli.main(base + extra) == 2
        assert message in capsys.readouterr().err
