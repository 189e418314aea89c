"""`dion3 plan` end to end on the fake process group: JSON output of a small preset, and a world
of 1024 ranks (FSDP2 + TP) planned on this CPU."""
from __future__ import annotations

import json

import pytest

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


def test_a_run_that_does_not_fit_the_gpu_is_named(capsys):
    """Llama-8B on one GPU: its 32 · (2·4096² + 2·1024·4096 + 3·14336·4096) = 6.98 B fp32 matrix
    parameters need 83.8 GB for parameters, gradients and momentum alone, so none of the optimizers
    fits an 83 GB GPU (the bench ran out of memory on an 80 GB H100 for this reason); on a 1000 GB
    one each fits, and the JSON says so per optimizer."""
    matrix_params = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    assert 3 * 4 * matrix_params / 1e9 > 83
    argv = ["--preset", "llama-8b", "--layout", "single", "--optimizers", "muon,normuon,dion3", "--quiet", "--ranks", "0"]
    assert cli.main(argv + ["--capacity-gb", "83"]) == 0
    warning = [line for line in capsys.readouterr().out.splitlines() if line.startswith("does not fit")]
    assert len(warning) == 1 and "GPU of 83 GB" in warning[0]
    assert all(f"{label} " in warning[0] for label in ("Muon", "NorMuon", "Dion3 f=1/4"))
    assert cli.main(argv + ["--capacity-gb", "1000"]) == 0
    assert "does not fit" not in capsys.readouterr().out
    for capacity, fits in (("83", False), ("1000", True)):
        assert cli.main(argv + ["--capacity-gb", capacity, "--json", "-"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert [entry["fits"] for entry in data["optimizers"]] == [fits] * 3
        assert all(entry["memory_gb_max"] > 3 * 4 * matrix_params / 1e9 for entry in data["optimizers"])


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
    # the held-out shape was measured at the same tokens a step: its efficiencies are shown beside
    assert "with the efficiencies of another shape, llama-512-6l" in out
    # by cost, Llama-1B's budget buys fewer rows than llama-384's (where e was measured): said
    assert "rows selected: this model / llama-384" in out and "fewer rows on this model" in out
    assert cli.main(["--preset", "llama-8b", "--layout", "fsdp=8", "--tokens-per-step", "4194304", "--quiet",
                     "--ranks", "0"]) == 0
    out = capsys.readouterr().out
    assert "step-efficiency from the measured regime nearest this run: llama-384" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("recommend muon:") or last.startswith("recommend normuon:")


def test_a_measured_tokens_per_second_sets_the_forward_and_backward(capsys):
    """--train-tps (torchtitan's logged tps, tokens a second a GPU): the forward and backward of a
    step is the step's tokens over the world's tokens a second, whatever the parameters."""
    base = ["--preset", "llama-8b", "--layout", "fsdp=8", "--tokens-per-step", "1048576"]
    advice = _advice(base + ["--train-tps", "7000"], capsys)
    assert advice["forward_backward_s"] == pytest.approx(1048576 / (8 * 7000), rel=1e-12)
    assert advice["run"]["flops_per_second"] == pytest.approx(6 * advice["run"]["parameters"] * 7000)
    for extra, message in ((["--train-tps", "7000", "--train-tflops", "400"], "give one"),
                           (["--train-tps", "0"], "--train-tps must be positive")):
        assert cli.main(base + extra + ["--quiet"]) == 2
        assert message in capsys.readouterr().err


def test_a_measured_variant_joins_the_advice_with_its_own_share_of_rows(tmp_path, capsys):
    """A data file that holds dion3-1/2-rows (three seeds) puts it beside the by-cost settings: its
    step priced, its e read, its rows those of fraction_allocation="most_rows" — on llama-384, where
    it was measured, every gate/up row and ⅓ of the others: 32256 of 41472 rows (0.778)."""
    data = _efficiencies(tmp_path, EFFICIENCIES + [("dion3-1/2-rows", 0.99, 0.98, 1.0)])
    advice = _advice(["--preset", "llama-1b", "--layout", "single", "--tokens-per-step", "8192",
                      "--efficiency", data], capsys)
    rows = next(p for p in advice["predictions"] if p["setting"] == "dion3-1/2-rows")
    assert rows["efficiency"]["value"] == 0.99 and rows["optimizer_s"] > 0
    shares = advice["row_shares"]
    assert shares["dion3-1/2-rows"]["measured_model"] == pytest.approx(32256 / 41472)
    assert shares["dion3-1/2-rows"]["this_model"] > shares["dion3-1/2-cost"]["this_model"]


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
    base = ["--layout", "single", "--quiet"]
    cases = [(["--preset", "llama-1b", "--tokens-per-step", "0"], "--tokens-per-step must be positive"),
             (["--preset", "llama-1b", "--tokens-per-step", "8192", "--train-tflops", "-1"], "--train-tflops must be positive"),
             (["--preset", "llama-1b", "--tokens-per-step", "8192", "--efficiency", str(tmp_path / "missing.json")],
              "--efficiency: cannot read step-efficiencies"),
             (["--shapes", "256x512:4", "--experts", "8", "--tokens-per-step", "8192"], "needs --parameters")]
    for extra, message in cases:
        assert cli.main(base + extra) == 2
        assert message in capsys.readouterr().err


def _config(tmp_path, name, **fields):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return str(folder / "config.json")


LLAMA_3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                  num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8, vocab_size=128256,
                  tie_word_embeddings=False)


def test_a_hugging_face_config_plans_as_its_preset(tmp_path, capsys):
    """Llama-3-8B's config.json gives the matrices of the llama-8b preset: the same 6.98 B matrix
    parameters (counted by hand) and the same priced steps, and the same time-to-loss answer."""
    path = _config(tmp_path, "Meta-Llama-3-8B", **LLAMA_3_8B)
    runs = {}
    for model in (["--hf-config", path], ["--preset", "llama-8b"]):
        out = tmp_path / "plan.json"
        assert cli.main(model + ["--layout", "fsdp=8", "--tokens-per-step", "1048576", "--json", str(out), "--quiet"]) == 0
        runs[model[0]] = json.loads(out.read_text())
    hand = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    assert hand == 6_979_321_856 and f"{hand / 1e9:.2f} B matrix parameters" in runs["--hf-config"]["header"]
    assert runs["--hf-config"]["model"] == "Meta-Llama-3-8B"
    assert runs["--hf-config"]["optimizers"] == runs["--preset"]["optimizers"]
    config, preset = (runs[k]["time_to_loss"] for k in ("--hf-config", "--preset"))
    assert config["run"]["parameters"] == hand + 128256 * 4096  # the matrices and the LM head
    assert config["predictions"] == preset["predictions"] and config["recommendation"] == preset["recommendation"]


def test_a_mixture_of_experts_config_counts_every_expert_and_the_active_ones(tmp_path):
    """A Mixtral-style config (4 experts, 2 a token) and a Qwen-MoE-style one with a shared expert
    and head_dim · heads ≠ hidden_size: the hidden parameters count every expert, a token's
    parameters the chosen ones (hand counts), and the experts' stacks are split by an ep axis."""
    d, layers, vocab = 64, 2, 100
    attention = layers * (2 * 64 * d + 2 * 32 * d)  # q, o: 4 heads × 16; k, v: 2 heads × 16
    moe = _config(tmp_path, "mixtral", hidden_size=d, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=layers, num_local_experts=4, num_experts_per_tok=2, vocab_size=vocab)
    out = tmp_path / "moe.json"
    assert cli.main(["--hf-config", moe, "--layout", "ep=2,fsdp=2", "--tokens-per-step", "4096", "--json", str(out),
                     "--quiet"]) == 0
    data = json.loads(out.read_text())
    router, expert = layers * 4 * d, 3 * 128 * d  # an expert: gate, up and down
    hidden = attention + router + layers * 4 * expert
    assert f"{hidden / 1e9:.2f} B matrix parameters" in data["header"]
    assert data["time_to_loss"]["run"]["parameters"] == attention + router + layers * 2 * expert + vocab * d
    assert data["time_to_loss"]["run"]["hidden_parameters"] == hidden
    for entry in data["optimizers"]:  # one owner each: 2 layers × (q, o, k, v, router), and each ep half of 3 stacks
        assert sum(r["owned"] for r in entry["ranks"]) == layers * 5 + layers * 3 * 2
    shares = data["time_to_loss"]["row_shares"]  # every expert's rows counted, beside llama-384's
    assert set(shares) == {"dion3-1/4-cost", "dion3-3/8-cost", "dion3-1/2-cost"}
    assert all(0 < s["this_model"] <= 1 and s["measured_model"] is not None for s in shares.values())
    wide = _config(tmp_path, "qwen-moe", hidden_size=d, head_dim=32, num_attention_heads=4, num_key_value_heads=1,
                   num_hidden_layers=layers, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=96, vocab_size=vocab, tie_word_embeddings=True)
    out = tmp_path / "wide.json"
    assert cli.main(["--hf-config", wide, "--layout", "single", "--tokens-per-step", "4096", "--json", str(out),
                     "--quiet"]) == 0
    run = json.loads(out.read_text())["time_to_loss"]["run"]
    attention = layers * (2 * 128 * d + 2 * 32 * d)  # q, o: 4 heads × 32 = 128; k, v: 1 head × 32
    dense = attention + layers * 8 * d + layers * 3 * 96 * d  # the router and the shared expert
    assert run["hidden_parameters"] == dense + layers * 8 * 3 * 32 * d
    assert run["parameters"] == dense + layers * 2 * 3 * 32 * d + vocab * d


def test_bad_hugging_face_configs_are_refused_by_name(tmp_path, capsys):
    good = _config(tmp_path, "llama", **LLAMA_3_8B)
    missing = _config(tmp_path, "no-layers", **{k: v for k, v in LLAMA_3_8B.items() if k != "num_hidden_layers"})
    latent = _config(tmp_path, "deepseek", **LLAMA_3_8B, kv_lora_rank=512)
    greedy = _config(tmp_path, "greedy", **LLAMA_3_8B, num_local_experts=4, num_experts_per_tok=8)
    negative = _config(tmp_path, "negative", **{**LLAMA_3_8B, "hidden_size": -1})
    (tmp_path / "broken.json").write_text("{not json")
    cases = [(["--hf-config", missing], "has no 'num_hidden_layers'"),
             (["--hf-config", latent], "sets kv_lora_rank (multi-head latent attention"),
             (["--hf-config", greedy], "num_experts_per_tok 8 exceeds the 4 experts"),
             (["--hf-config", negative], "hidden_size must be a positive integer, got -1"),
             (["--hf-config", str(tmp_path / "broken.json")], "is not JSON"),
             (["--hf-config", str(tmp_path / "absent.json")], "--hf-config: cannot read"),
             (["--hf-config", good, "--preset", "llama-8b"], "--preset and --hf-config each name the model"),
             (["--hf-config", good, "--experts", "8"], "--hf-config gives the experts itself")]
    for extra, message in cases:
        assert cli.main(extra + ["--layout", "single", "--quiet"]) == 2, extra
        assert message in capsys.readouterr().err, extra
    # a model_type the reading was not written for is read, with a note that says what was assumed;
    # a null head_dim (as some configs write it) is the default hidden_size / heads
    fused = _config(tmp_path, "phi3", **{**LLAMA_3_8B, "model_type": "phi3", "head_dim": None})
    assert cli.main(["--hf-config", fused, "--layout", "single", "--quiet", "--ranks", "0"]) == 0
    captured = capsys.readouterr()
    assert "note: model_type 'phi3' is not one this reading was written for" in captured.err
    assert "6.98 B matrix parameters" in captured.out
    assert cli.main(["--hf-config", good, "--layout", "single", "--quiet", "--ranks", "0"]) == 0
    assert "note:" not in capsys.readouterr().err  # llama: no note
