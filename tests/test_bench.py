"""`dion3 bench`: presets, the FLOP/byte cost model against hand counts, and CPU end-to-end runs."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from dion3.tools import cli
from dion3.tools.bench import presets, step_cost as flops, step_time as step
from dion3.tools.bench.presets import PRESETS, MatrixShape, parse_shapes
from dion3.tools.models import COMMANDS, REGISTRY, takes
from dion3.optim.cost_fractions import cost_allocated_fractions
from dion3.ortho.cost import modeled_seconds


# ------------------------------------------------------------------------ presets
def test_llama_presets_match_the_published_matrix_counts():
    # DESIGN §8: Llama-1B 16 layers of q,o 2048², k,v 512×2048, gate/up 8192×2048, down 2048×8192.
    one_b = 16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 2 * 8192 * 2048 + 2048 * 8192)
    eight_b = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 2 * 14336 * 4096 + 4096 * 14336)
    assert PRESETS["llama-1b"].matrix_numel == one_b == 973_078_528
    assert PRESETS["llama-8b"].matrix_numel == eight_b == 6_979_321_856
    assert sum(m.count for m in PRESETS["llama-8b"].matrices) == 32 * 7


def test_llama_70b_preset_is_a_slice_of_eight_layers():
    # Llama 3.1 70B: q,o 8192², k,v 1024×8192, gate/up 28672×8192, down 8192×28672, 80 layers.
    per_layer = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 2 * 28672 * 8192 + 8192 * 28672
    preset = PRESETS["llama-70b"]
    assert per_layer == 855_638_016
    assert preset.layers == 8 and preset.matrix_numel == 8 * per_layer
    assert "8 of its 80 layers" in preset.description
    assert PRESETS["llama-8b"].layers == 32


def test_per_layer_time_is_the_step_over_the_preset_layers(monkeypatch, tmp_path):
    monkeypatch.setattr(step, "measure", lambda *args: dict(device_ms=12.0, host_ms=0.1))
    args = step.parse_args(["--device", "cpu", "--no-graph", "--preset", "llama-70b"])
    row = step.run_variant(step.parse_variant("dion3-1/4"), False, PRESETS["llama-70b"], args, torch.device("cpu"), None)
    assert row["layer_ms"] == pytest.approx(12.0 / 8)
    assert "ms/layer" in step.format_table([row])


# every name of the registry, each command's own check of it, and one name no command takes
NAMES = [*REGISTRY, "llama-9000"]


def _taken(command: str, name: str, capsys) -> tuple[bool, str]:
    """Whether `command` takes the model name (as its command line checks it, up to where it
    would start training or timing; `dion3 plan` and `dion3 fractions` run whole), and its error."""
    from dion3.tools.plan import cli as plan, fractions
    from dion3.tools.study import cli as study
    from dion3.tools.train import compare

    capsys.readouterr()
    try:
        if command == "compare":
            compare.parse_args(["--preset", name])
        elif command == "bench":
            assert step.parse_args(["--preset", name, "--device", "cpu", "--no-graph"]).source.name == name
        elif command == "study":
            assert study.parse_args(["--model", name]).model == name
        else:
            main = plan.main if command == "plan" else fractions.main
            flags = ["--layout", "single", "--quiet", "--ranks", "1"] if command == "plan" else []
            if main(["--preset", name, *flags]) != 0:
                return False, capsys.readouterr().err
    except SystemExit as exit:
        assert exit.code == 2
        return False, capsys.readouterr().err
    return True, ""


@pytest.mark.parametrize("command", ["compare", "bench", "plan", "fractions", "study"])
def test_every_model_name_is_taken_or_refused_naming_the_commands_that_take_it(command, capsys):
    """One registry of model names (dion3.tools.models) for `dion3 compare`, `bench`, `plan`,
    `fractions` and the study: a command takes a name or says which commands do."""
    taken = set()
    for name in NAMES:
        ok, error = _taken(command, name, capsys)
        model = REGISTRY.get(name)
        if ok:
            taken.add(name)
            assert model is not None and command in model.commands, name
            continue
        if model is None:  # no command's name: the error lists this command's names
            assert f"unknown model {name!r}; {COMMANDS[command]} takes {', '.join(takes(command))}" in error, error
            continue
        assert command not in model.commands and f"{name!r} is taken by " in error, error
        assert all(COMMANDS[other] in error for other in model.commands), error
    study = {"llama-384", "llama-hf", "llama-hf-110m", "llama-hf-350m", "llama-512-6l", "gpt-tiny", "gpt-25m", "gpt-120m"}
    demo, llamas = {"cpu-tiny", "gpu-small"}, {"llama-1b", "llama-8b", "llama-70b"}
    expected = {
        "compare": demo, "study": study,
        "bench": set(REGISTRY) - {"llama-405b", "14b"},  # too large for one GPU; llama-70b: 8 of its 80 layers
        "plan": set(REGISTRY), "fractions": set(REGISTRY),
    }[command]
    assert taken == expected
    if command in ("bench", "plan", "fractions"):
        assert study | demo | llamas <= taken


def test_the_commands_own_tables_hold_the_registry_s_names():
    """compare's presets (schedules, lrs) and the study's models (context, batch) are the names
    the registry gives those commands, with the registry's shapes."""
    import dataclasses

    from dion3.tools.study.runs import MODELS as STUDY
    from dion3.tools.train import compare

    assert sorted(compare.PRESETS) == takes("compare") and sorted(STUDY) == takes("study")
    for name, spec in STUDY.items():
        model = REGISTRY[name]
        assert (spec.n_layer, spec.d_model, spec.n_head) == (model.n_layer, model.d_model, model.n_head)
        if spec.kind == "llama-hf":
            assert (spec.kv_heads, spec.mlp_width) == (model.kv_heads, model.mlp_width)
        else:
            assert model.family == "gpt" and model.mlp_width == 4 * model.d_model
    for name, preset in compare.PRESETS.items():
        config = preset.model
        assert dataclasses.replace(config, seq_len=1) == compare.gpt_config(name, seq_len=1)


@pytest.mark.parametrize("name", ["cpu-tiny", "gpu-small"])
def test_a_demo_preset_lists_the_shapes_of_the_model_dion3_compare_trains(name):
    """Built on the meta device as `dion3 compare` builds it (byte vocabulary), its matrices are
    the preset's matrices and its other parameters the preset's scalars."""
    import dataclasses

    from dion3 import param_groups
    from dion3.tools.train import compare
    from dion3.tools.train.model import GPT

    with torch.device("meta"):
        model = GPT(dataclasses.replace(compare.PRESETS[name].model, vocab_size=256))
    assert built_shapes(model, model.lm_head, param_groups) == listed_shapes(REGISTRY[name].preset())


def built_shapes(model, lm_head, param_groups) -> tuple[list, list]:
    """(matrix shapes, other shapes) of a built model as param_groups sorts its parameters."""
    groups = param_groups(model, lm_head=lm_head)
    matrices = sorted(tuple(p.shape) for g in groups if "algorithm" not in g for p in g["params"])
    others = sorted(tuple(p.shape) for g in groups if g.get("algorithm") == "adamw" for p in g["params"])
    assert len(matrices) + len(others) == len(list(model.parameters()))
    return matrices, others


def listed_shapes(preset) -> tuple[list, list]:
    """(matrix shapes, other shapes) a preset lists, one entry per parameter."""
    return (sorted((m.rows, m.cols) for m in preset.matrices for _ in range(m.count)),
            sorted(s.shape for s in preset.scalars for _ in range(s.count)))


def test_docs_list_each_model_name_with_the_commands_that_take_it():
    """docs/training.md, "Model names": every name once, a ✓ under each command that takes it."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "training.md").read_text()
    section = text.split("### Model names: which command takes which", 1)[1].split("\n#", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ") and "✓" in line]
    columns = [("compare",), ("bench",), ("plan", "fractions"), ("study",)]
    listed = {}
    for cells in rows:
        for name in cells[0].split(","):
            assert name.strip() not in listed, name
            listed[name.strip()] = tuple(c for column, cell in zip(columns, cells[2:]) if "✓" in cell for c in column)
    assert listed == {name: model.commands for name, model in REGISTRY.items()}  # commands in COMMANDS' order


def test_bench_times_a_study_model_s_shapes_on_the_cpu(capsys):
    assert cli.main(["bench", "--preset", "gpt-tiny", "--device", "cpu", "--steps", "1", "--warmup", "1",
                     "--optimizers", "muon,dion3-1/4-cost"]) == 0
    assert "gpt-tiny: GPT, 2 layers, d=64, 2 heads" in capsys.readouterr().out


def test_parse_shapes_reads_counts_and_rejects_garbage():
    preset = parse_shapes("4096x4096:32, 1024x4096")
    assert [(m.rows, m.cols, m.count) for m in preset.matrices] == [(4096, 4096, 32), (1024, 4096, 1)]
    for bad in ("4096by4096", "0x4:2", "4x4:0", ""):
        with pytest.raises(ValueError, match="--shapes"):
            parse_shapes(bad)


# ------------------------------------------------------------------------ FLOP model
def test_standard_ns_flops_hand_count():
    # 2×4 (and its transpose): per step XXᵀ 2·2·2·4 = 32, A² 2·2·2·2 = 16, (bA+cA²)X 32 → 80; 5 steps.
    assert flops.orthogonalize_flops(2, 4, "newton_schulz", False) == (400, 400)
    assert flops.orthogonalize_flops(4, 2, "newton_schulz", False) == (400, 400)


def test_gram_flops_match_design_formula_and_restart_free_count():
    n, m = 64, 640
    dense, executed = flops.orthogonalize_flops(n, m, "gram", False, restarts=(2,))
    assert dense == executed == 8 * n * n * m + 28 * n ** 3  # DESIGN §3, T = 5, one restart
    # No restart: R = XXᵀ, 5 Z's, Q·Z at steps 2–5, P and R at steps 1–4, final Q·X.
    no_restart = 2 * n * n * m + 5 * 2 * n ** 3 + 4 * 2 * n ** 3 + 4 * 4 * n ** 3 + 2 * n * n * m
    assert flops.orthogonalize_flops(n, m, "gram", False, restarts=())[0] == no_restart


def test_symmetric_kernels_discount_only_symmetric_products():
    n, m = 512, 1024  # 4 tiles of 128 per side: 10 of 16 tiles computed
    share = 10 / 16
    _, ns = flops.orthogonalize_flops(n, m, "newton_schulz", True)
    assert ns == pytest.approx(5 * (share * (2 * n * n * m + 2 * n ** 3) + 2 * n * n * m))
    _, gram = flops.orthogonalize_flops(n, m, "gram", True, restarts=(2,))
    # Symmetric: both XXᵀ and all 28n³; dense: the two Q·X products.
    assert gram == pytest.approx(share * (4 * n * n * m + 28 * n ** 3) + 4 * n * n * m)
    # A rule of n: below the threshold nothing is discounted.
    assert flops.orthogonalize_flops(n, m, "newton_schulz", lambda size: size > n)[1] == 5 * (4 * n * n * m + 2 * n ** 3)


@pytest.mark.parametrize("ratio, gram_wins", [(1.25, False), (1.4, False), (1.6, True), (3.0, True)])
def test_gram_beats_standard_ns_above_aspect_ratio_one_and_a_half(ratio, gram_wins):
    n = 200
    m = int(ratio * n)
    gram = flops.orthogonalize_flops(n, m, "gram", False, restarts=(2,))[0]
    standard = flops.orthogonalize_flops(n, m, "newton_schulz", False)[0]
    assert (gram < standard) == gram_wins


def test_elementwise_bytes_and_dion3_selection():
    assert flops.elementwise_bytes("adamw", 8, 4, 8) == 28 * 32
    # fp32: read G, M, write M, read M to cast, read and write X; half: write U, read O.
    assert flops.elementwise_bytes("muon", 8, 4, 8) == 4 * 6 * 32 + 2 * 32 + 2 * 32
    assert flops.elementwise_bytes("normuon", 8, 4, 8) == 30 * 32
    # f = 1/4 of 8 rows → 2 rows of 4: 20 B on every element, 14 B on each selected one.
    assert flops.elementwise_bytes("dion3", 8, 4, 2) == 20 * 32 + 14 * 8


def test_step_cost_sums_shapes_and_scales_with_fraction():
    shapes = [MatrixShape("a", 64, 256, 3), MatrixShape("b", 256, 64, 2)]
    cost = flops.step_cost(shapes, "muon", method="newton_schulz")
    per_matrix = 5 * (4 * 64 * 64 * 256 + 2 * 64 ** 3)
    assert cost.dense_flops == 5 * per_matrix
    assert cost.bytes_moved == 28 * 5 * 64 * 256 and cost.bytes_sent == 0
    # Dion3 f=1/4 on 256×64: k = 64 rows → a square 64×64 orthogonalization per matrix.
    dion = flops.step_cost([MatrixShape("b", 256, 64, 2)], "dion3", 0.25, method="newton_schulz")
    assert dion.dense_flops == 2 * 5 * 6 * 64 ** 3
    adamw = flops.step_cost(shapes, "adamw", scalar_numel=1000)
    assert adamw.dense_flops == 0 and adamw.bytes_moved == 28 * (5 * 64 * 256 + 1000)
    assert cost.floor_seconds(1e12, 1e9) == pytest.approx(cost.dense_flops / 1e12 + cost.bytes_moved / 1e9)
    with pytest.raises(ValueError, match="fraction"):
        flops.step_cost(shapes, "muon", fraction=0.5)


def test_step_cost_takes_one_fraction_per_shape():
    shapes = [MatrixShape("a", 64, 32, 3), MatrixShape("b", 16, 32, 2)]
    # per shape: a at 1/8 → 8 rows of 32, b at 1/2 → 8 rows of 32: five 8×32 NS orthogonalizations
    per_shape = flops.step_cost(shapes, "dion3", [0.125, 0.5], method="newton_schulz")
    assert per_shape.dense_flops == 5 * 5 * (4 * 8 * 8 * 32 + 2 * 8 ** 3)
    assert per_shape.bytes_moved == 3 * (20 * 64 * 32 + 14 * 8 * 32) + 2 * (20 * 16 * 32 + 14 * 8 * 32)
    assert flops.step_cost(shapes, "dion3", (0.25, 0.25), world_size=4) == flops.step_cost(shapes, "dion3", 0.25, world_size=4)
    with pytest.raises(ValueError, match="2 matrix shapes"):
        flops.step_cost(shapes, "dion3", [0.25])


def test_bytes_sent_hand_count():
    shape = MatrixShape("x", 8, 16, 3)
    assert flops.sent_bytes(shape, None, 1) == 0
    # FSDP W=4: 2 local rows each; 3/4 of them leave and come back: 2·3·(3/4)·2·16·4 B.
    assert flops.sent_bytes(shape, None, 4) == 576
    assert flops.sent_bytes(shape, 0.5, 4) == 288  # 1 local row of 2
    assert flops.sent_bytes(shape, 0.5, 4, scope="global") == 288 + 3 * 3 * 2 * 4
    # DDP W=4: each rank owns ⌈3/4⌉ = 1 matrix and sends it (8 rows, fp32) to 3 ranks.
    assert flops.sent_bytes(shape, None, 4, layout="ddp") == 3 * 8 * 16 * 4
    with pytest.raises(ValueError, match="layout"):
        flops.sent_bytes(shape, None, 4, layout="ring")


def test_muon_baseline_on_llama_1b_matches_hand_sum():
    expected = 0
    for rows, cols, count in ((2048, 2048, 32), (512, 2048, 32), (8192, 2048, 32), (2048, 8192, 16)):
        n, m = min(rows, cols), max(rows, cols)
        expected += count * 5 * (4 * n * n * m + 2 * n ** 3)
    assert flops.step_cost(PRESETS["llama-1b"].matrices, "muon", method="newton_schulz").dense_flops == expected


# ------------------------------------------------------------------------ the benchmark itself
def test_variant_names():
    assert step.parse_variant("dion3-1/8").fraction == 0.125
    assert step.parse_variant("dion3-0.3").fraction == pytest.approx(0.3)
    baseline = step.parse_variant("muon")
    assert baseline.orthogonalizer == "newton_schulz" and not baseline.kernels
    for bad in ("dion3-0", "dion3-3/2", "dion3-x", "sgd"):
        with pytest.raises(ValueError, match="--optimizers"):
            step.parse_variant(bad)


def test_cost_variant_names():
    cost = step.parse_variant("dion3-1/4-cost")
    assert (cost.name, cost.algorithm, cost.fraction, cost.allocation) == ("dion3-1/4-cost", "dion3", 0.25, "cost")
    assert step.parse_variant("dion3-0.125-cost").fraction == 0.125
    assert step.parse_variant("dion3-1-cost").fraction == 1.0
    assert step.parse_variant("dion3-1/4").allocation == "uniform"
    assert step.parse_variant("muon").allocation == "uniform"
    for bad in ("dion3-0-cost", "dion3-3/2-cost", "dion3-x-cost", "dion3-cost", "dion3--cost", "dion3-1/4-costs",
                "dion3-1/4-cost-cost", "dion3-1/0-cost", "muon-cost"):
        with pytest.raises(ValueError, match=r"--optimizers: unknown optimizer " + re.escape(repr(bad))):
            step.parse_variant(bad)


def test_bench_times_a_hugging_face_config_s_matrices_each_expert_one(tmp_path, capsys):
    config = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  num_local_experts=4, num_experts_per_tok=2, vocab_size=100)
    path, out = tmp_path / "config.json", tmp_path / "bench.json"
    path.write_text(json.dumps(config))
    assert step.main(["--device", "cpu", "--hf-config", str(path), "--optimizers", "muon-gram,dion3-1/2", "--steps", "1",
                      "--warmup", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    counts = {m["name"]: (m["rows"], m["cols"], m["count"]) for m in report["source"]["matrices"]}
    assert counts == {"q": (64, 64, 2), "o": (64, 64, 2), "k,v": (32, 64, 4), "router": (4, 64, 2),
                      "experts.gate,up": (128, 64, 2 * 2 * 4), "experts.down": (64, 128, 2 * 4)}
    assert all("error" not in row for row in report["results"])


def test_bench_refuses_a_model_larger_than_the_free_memory(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(step, "run_variant", lambda *args: ran.append(args) or dict(name="muon", mode="eager", error="not run here"))
    monkeypatch.setattr(presets, "free_bytes", lambda device: 10 ** 9)
    assert step.main(["--device", "cpu", "--preset", "llama-1b", "--optimizers", "muon"]) == 2 and not ran
    message = capsys.readouterr().err
    need = 12 * PRESETS["llama-1b"].matrix_numel / 1e9  # fp32 matrices, gradients and momentum
    assert f"llama-1b: its matrices need {need:.1f} GB" in message and "1.0 GB free" in message
    monkeypatch.setattr(presets, "free_bytes", lambda device: None)  # unknown: no refusal
    step.main(["--device", "cpu", "--preset", "llama-1b", "--optimizers", "muon"])
    assert len(ran) == 1


def test_a_slice_of_layers_is_offered_and_timed_when_the_model_does_not_fit(monkeypatch, capsys, tmp_path):
    """Llama-1B's layer holds 2·2048² + 2·512·2048 + 3·8192·2048 = 60.8 M matrix parameters, 0.73 GB
    in fp32 with gradients and momentum: with 5 GB free the refusal offers 6 of its 16 layers, and
    --layers 6 then times those (the report names the slice, so it is not read as the whole model)."""
    ran = []
    monkeypatch.setattr(step, "run_variant", lambda *args: ran.append(args) or dict(name="muon", mode="eager", error="not run here"))
    monkeypatch.setattr(presets, "free_bytes", lambda device: 5 * 10 ** 9)
    per_layer = 2 * 2048 ** 2 + 2 * 512 * 2048 + 3 * 8192 * 2048
    assert int(5e9 // (12 * per_layer)) == 6
    assert step.main(["--device", "cpu", "--preset", "llama-1b", "--optimizers", "muon"]) == 2 and not ran
    assert "--layers 6" in capsys.readouterr().err
    out = tmp_path / "bench.json"
    # not refused (2): it ran, and the stand-in run's error row makes the status 1
    assert step.main(["--device", "cpu", "--preset", "llama-1b", "--layers", "6", "--optimizers", "muon",
                      "--json", str(out)]) == 1 and len(ran) == 1
    source = json.loads(out.read_text())["source"]
    assert source["name"] == "llama-1b-6l" and source["layers"] == 6
    assert sum(m["rows"] * m["cols"] * m["count"] for m in source["matrices"]) == 6 * per_layer
    for bad in (["--preset", "llama-1b", "--layers", "17"], ["--preset", "llama-1b", "--layers", "0"],
                ["--shapes", "64x64", "--layers", "1"]):
        with pytest.raises(SystemExit):
            step.main(["--device", "cpu", *bad])
        assert "--layers" in capsys.readouterr().err


def test_rule_variant_names():
    """The frontier's rule variants as the bench names them: a fixed Dion3 setting with
    -unselectedD and/or -full-everyK last, its name the setting's one spelling; each fault named."""
    decayed = step.parse_variant("dion3-0.5-cost-unselected0.90")
    assert (decayed.name, decayed.fraction, decayed.allocation, decayed.unselected_decay, decayed.full_every) == \
        ("dion3-1/2-cost-unselected0.9", 0.5, "cost", 0.9, 0)
    both = step.parse_variant("dion3-3/8-unselected0.95-full-every8")
    assert (both.name, both.allocation, both.unselected_decay, both.full_every) == \
        ("dion3-3/8-unselected0.95-full-every8", "uniform", 0.95, 8)
    assert step.parse_variant("dion3-1/2-cost:bf16").full_every == 0
    faults = {"dion3-1/2-unselected1": "D in \\(0, 1\\)", "dion3-1/2-unselected0": "D in", "dion3-1/2-unselectedx": "cannot read",
              "dion3-1/2-full-every1": "K ≥ 2", "dion3-1/2-full-every8-unselected0.9": "in that order",
              "dion3-1/4-warmup200-full-every8": "drop the warm-up", "muon-full-every8": "follow a Dion3 setting"}
    for bad, why in faults.items():
        with pytest.raises(ValueError, match=r"--optimizers: .*" + re.escape(repr(bad))) as raised:
            step.parse_variant(bad)
        assert re.search(why, str(raised.value)), (bad, str(raised.value))


def test_the_unselected_rows_decay_pass_moves_their_bytes():
    # 8×4 at f = 1/4: 2 rows selected, the decay reads and writes the other 6 rows of 4 (fp32, then bf16)
    shape = [MatrixShape("a", 8, 4, 3)]
    plain = flops.step_cost(shape, "dion3", 0.25)
    decayed = flops.step_cost(shape, "dion3", 0.25, decays_unselected=True)
    assert decayed.bytes_moved - plain.bytes_moved == 3 * 2 * 4 * 6 * 4
    assert decayed.dense_flops == plain.dense_flops
    half = flops.step_cost(shape, "dion3", 0.25, momentum_bytes=2, decays_unselected=True)
    assert half.bytes_moved - flops.step_cost(shape, "dion3", 0.25, momentum_bytes=2).bytes_moved == 3 * 2 * 2 * 6 * 4


def test_periodic_full_steps_run_every_row_each_kth_step_and_are_timed_in_cycles(monkeypatch, tmp_path):
    """-full-every4 over groups by cost: every 4th step runs every group at fraction 1, the others
    at their by-cost fractions; timed steps come in whole cycles and the row is the median of the
    cycles' means; its cost is one full step and three selecting ones over four. -unselected0.9
    builds Dion3 with that decay and prices its pass."""
    real = step.make_optimizer
    seen: dict[str, list] = {}

    def recording(variant, *args, **kwargs):
        optimizer = real(variant, *args, **kwargs)
        plain = optimizer.step
        calls = seen.setdefault(variant.name, [])

        def stepping(*a, **k):
            calls.append(tuple(g["fraction"] for g in optimizer.param_groups))
            return plain(*a, **k)

        optimizer.step = stepping
        seen[variant.name + " decay"] = [g["unselected_decay"] for g in optimizer.param_groups]
        return optimizer

    monkeypatch.setattr(step, "make_optimizer", recording)
    shapes, path = "16x32:2,64x32", tmp_path / "bench.json"
    assert step.main(["--device", "cpu", "--shapes", shapes, "--steps", "5", "--warmup", "1", "--json", str(path),
                      "--optimizers", "dion3-1/2-cost,dion3-1/2-cost-full-every4,dion3-1/2-cost-unselected0.9"]) == 0
    rule, periodic, decayed = json.loads(path.read_text())["results"]
    assert all("error" not in r for r in (rule, periodic, decayed)), [r.get("error") for r in (rule, periodic, decayed)]
    by_cost = seen["dion3-1/2-cost"][0]
    assert any(f < 1 for f in by_cost)
    calls = seen["dion3-1/2-cost-full-every4"]
    assert len(calls) % 4 == 0 and len(calls) >= 4 * 4  # whole cycles; the warm-up captures both selections
    for index, fractions in enumerate(calls):
        assert fractions == ((1.0,) * len(by_cost) if index % 4 == 3 else by_cost), index
    times = periodic["device_ms_all"]
    assert len(times) == 8  # 5 timed steps asked: two cycles of 4
    assert periodic["device_ms"] == pytest.approx((sum(times[:4]) / 4 + sum(times[4:]) / 4) / 2)  # median of two
    assert "cycles of 4 steps" in periodic["statistic"]
    matrices = parse_shapes(shapes).matrices
    # one group per shape, in the shapes' order (test_cost_variant_builds_one_group_per_shape_at_the_cost_fractions)
    full, selecting = (flops.step_cost(matrices, "dion3", f) for f in (1.0, list(by_cost)))
    assert periodic["model"]["executed_flops"] == pytest.approx((full.executed_flops + 3 * selecting.executed_flops) / 4)
    assert periodic["model"]["bytes_moved"] == pytest.approx((full.bytes_moved + 3 * selecting.bytes_moved) / 4)
    assert seen["dion3-1/2-cost-unselected0.9 decay"] == [0.9] * len(by_cost)
    assert decayed["model"]["bytes_moved"] > rule["model"]["bytes_moved"]
    assert decayed["model"]["dense_flops"] == rule["model"]["dense_flops"]


def test_default_list_times_every_setting_the_readme_measures():
    """`dion3 bench` with no --optimizers times the README's settings: ½, ⅜ and ¼ by cost (its "Which
    setting" table), and every fraction by cost in the README's usage code among them."""
    defaults = [step.parse_variant(name) for name in step.DEFAULT_OPTIMIZERS.split(",")]
    by_cost = {v.name for v in defaults if v.allocation == "cost"}
    assert by_cost == {"dion3-1/2-cost", "dion3-3/8-cost", "dion3-1/4-cost"}
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("## Usage")
    usage = readme[start:readme.index("\n## ", start)]
    recommended = {float(f) for f in re.findall(r'fraction=([\d.]+), fraction_allocation="cost"', usage)}
    assert recommended and recommended <= {v.fraction for v in defaults if v.allocation == "cost"}
    table = readme[readme.index("## Which setting"):]
    assert all(f"Dion3 {text} by cost" in table for text in ("½", "⅜", "¼"))


# llama-like: square (q, o, twice), short (k/v), tall (gate/up) and wide (down) matrices
COST_SHAPES = "32x32,8x32:2,32x32,64x32:2,32x64"


def cost_optimizer():
    matrices, _ = step.make_parameters(parse_shapes(COST_SHAPES), torch.device("cpu"), False)
    return matrices, step.make_optimizer(step.parse_variant("dion3-1/4-cost"), matrices, [], torch.device("cpu"), graph=False)


def test_cost_variant_builds_one_group_per_shape_at_the_cost_fractions():
    torch.manual_seed(0)
    matrices, optimizer = cost_optimizer()
    distinct = [MatrixShape("", r, c, n) for (r, c), n in {(32, 32): 2, (8, 32): 2, (64, 32): 2, (32, 64): 1}.items()]
    expected = dict(zip([(s.rows, s.cols) for s in distinct], cost_allocated_fractions(distinct, 0.25)))
    groups = optimizer.param_groups
    assert len(groups) == 4
    got = {}
    for group in groups:
        shapes = {tuple(p.shape) for p in group["params"]}
        assert len(shapes) == 1, shapes  # one shape per group
        got[shapes.pop()] = group["fraction"]
    assert got == expected
    assert sum(len(g["params"]) for g in groups) == len(matrices) == 7
    assert len({f for f in got.values()}) > 1 and any(f != 0.25 for f in got.values())
    # the step moves ⌈f·rows⌉ rows of each matrix, f its shape's fraction
    before = [p.detach().clone() for p in matrices]
    optimizer.step()
    decay = 1 - 0.01 * 0.01
    for p, old in zip(matrices, before):
        moved = (p.detach() - old * decay).abs().amax(dim=1) > 1e-6
        assert int(moved.sum()) == round(expected[tuple(p.shape)] * p.shape[0])


def hand_flops(fractions: dict, symmetric=False) -> tuple[float, float]:
    """(dense, executed) FLOPs of COST_SHAPES at {(rows, cols): fraction}, summed entry by entry."""
    dense = executed = 0.0
    for shape in parse_shapes(COST_SHAPES).matrices:
        k = math.ceil(fractions[(shape.rows, shape.cols)] * shape.rows - 1e-9)
        d, e = flops.orthogonalize_flops(k, shape.cols, "auto", symmetric)
        dense, executed = dense + shape.count * d, executed + shape.count * e
    return dense, executed


def test_cpu_run_of_the_cost_variant_reports_the_flops_it_executes(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = cli.main(["bench", "--device", "cpu", "--no-graph", "--shapes", COST_SHAPES, "--steps", "1", "--warmup", "1",
                     "--optimizers", "dion3-1/4,dion3-1/4-cost", "--json", str(path)])
    assert code == 0
    out, err = capsys.readouterr()
    uniform, cost = json.loads(path.read_text())["results"]
    assert "error" not in uniform and "error" not in cost, (uniform.get("error"), cost.get("error"))
    assert cost["name"] == "dion3-1/4-cost" and cost["variant"]["allocation"] == "cost" and "dion3-1/4-cost" in out
    assert cost["device_ms"] > 0 and cost["tflops"] is not None
    # the fractions the optimizer's groups really run at (read from a built optimizer, not from the cost model)
    torch.manual_seed(0)
    _, optimizer = cost_optimizer()
    ran = {tuple(g["params"][0].shape): g["fraction"] for g in optimizer.param_groups}
    dense, executed = hand_flops(ran)
    assert cost["model"]["dense_flops"] == int(dense)
    assert cost["model"]["executed_flops"] == pytest.approx(executed, rel=1e-12)
    assert uniform["model"]["executed_flops"] == pytest.approx(hand_flops(dict.fromkeys(ran, 0.25))[1], rel=1e-12)
    # the allocation keeps the uniform fraction's modeled time (not its FLOPs: dion3.optim.cost_fractions)
    def modeled_total(fractions):
        return sum(s.count * modeled_seconds(math.ceil(fractions[(s.rows, s.cols)] * s.rows - 1e-9), s.cols)
                   for s in parse_shapes(COST_SHAPES).matrices)
    assert modeled_total(ran) <= modeled_total(dict.fromkeys(ran, 0.25)) * (1 + 1e-9)
    assert cost["model"]["executed_flops"] != uniform["model"]["executed_flops"]  # other rows, so other FLOPs
    # (bytes_moved may be equal: on shapes this small every k pads to one 128-row block, so the
    # modeled time spends the uniform fraction's selected-row traffic exactly)
    assert cost["tflops"] == pytest.approx(cost["model"]["dense_flops"] / (cost["device_ms"] / 1e3) / 1e12)


def test_cost_variant_on_a_llama_preset_keeps_the_uniform_budget():
    """The cost variant's fractions keep dion3-1/4's modeled H200 time (the allocation's budget),
    and its FLOP figure at H200 dispatch is the sum over the preset's shapes."""
    preset = PRESETS["llama-8b"]
    variant = step.parse_variant("dion3-1/4-cost")
    fractions = cost_allocated_fractions(preset.matrices, 0.25)
    executed = 0.0
    for shape, f in zip(preset.matrices, fractions):
        k = math.ceil(f * shape.rows - 1e-9)
        executed += shape.count * flops.orthogonalize_flops(k, shape.cols, "auto", flops.h200_symmetric)[1]
    by_cost = flops.step_cost(preset.matrices, "dion3", step.shape_fractions(variant, preset), symmetric=flops.h200_symmetric)
    assert by_cost.executed_flops == pytest.approx(executed, rel=1e-12)
    seconds = [shape.count * modeled_seconds(math.ceil(f * shape.rows - 1e-9), shape.cols) for shape, f in zip(preset.matrices, fractions)]
    quarter = [shape.count * modeled_seconds(math.ceil(shape.rows / 4), shape.cols) for shape in preset.matrices]
    assert sum(seconds) <= sum(quarter) * (1 + 1e-9)
    assert any(f != 0.25 for f in fractions)


def test_dion3_variant_moves_only_its_fraction_of_rows():
    torch.manual_seed(0)
    matrices, _ = step.make_parameters(parse_shapes("8x16:2"), torch.device("cpu"), False)
    before = [p.detach().clone() for p in matrices]
    optimizer = step.make_optimizer(step.parse_variant("dion3-1/4"), matrices, [], torch.device("cpu"), graph=False)
    optimizer.step()
    decay = 1 - 0.01 * 0.01  # lr · weight_decay of the benchmark's optimizers
    for p, old in zip(matrices, before):
        moved = (p.detach() - old * decay).abs().amax(dim=1) > 1e-6
        assert int(moved.sum()) == math.ceil(8 / 4)


def test_cpu_run_end_to_end_writes_json_and_table(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = cli.main([
        "bench", "--device", "cpu", "--shapes", "48x96:2,96x48,32x32:2", "--steps", "3", "--warmup", "2",
        "--optimizers", "adamw,muon,muon-gram,normuon,dion3-1/2,dion3-1/4", "--json", str(path),
    ])
    assert code == 0
    out, err = capsys.readouterr()
    report = json.loads(path.read_text())
    rows = report["results"]
    assert [r["name"] for r in rows] == ["adamw", "muon", "muon-gram", "normuon", "dion3-1/2", "dion3-1/4"]
    assert all(r["mode"] == "eager" and "error" not in r for r in rows), [r.get("error") for r in rows]
    assert "--shapes 48x96:2,96x48,32x32:2" in report["command"]
    shapes = parse_shapes("48x96:2,96x48,32x32:2").matrices
    for row in rows:
        assert len(row["device_ms_all"]) == 3 and row["device_ms"] > 0 and row["host_ms"] > 0
        assert row["first_step_s"] <= row["ready_s"]
        assert row["bytes_sent"] == 0
        muon_like = row["variant"]["algorithm"] != "adamw"
        assert (row["model"]["dense_flops"] > 0) == muon_like and (row["tflops"] is not None) == muon_like
    baseline = rows[1]
    assert baseline["speedup"] == 1.0
    assert baseline["model"]["dense_flops"] == flops.step_cost(shapes, "muon", method="newton_schulz").dense_flops
    assert rows[0]["speedup"] == pytest.approx(baseline["device_ms"] / rows[0]["device_ms"])
    for name in ("muon-gram", "dion3-1/4"):
        assert name in out
    assert "[1/6] adamw eager" in err and "[6/6] dion3-1/4 eager" in err


def test_a_failing_variant_reports_its_error_and_the_rest_still_run(monkeypatch, tmp_path, capsys):
    real = step.make_optimizer

    def flaky(variant, *args, **kwargs):
        if variant.name == "normuon":
            raise RuntimeError("out of memory (simulated)")
        return real(variant, *args, **kwargs)

    monkeypatch.setattr(step, "make_optimizer", flaky)
    path = tmp_path / "bench.json"
    code = step.main(["--device", "cpu", "--shapes", "16x32", "--steps", "1", "--warmup", "1",
                      "--optimizers", "muon,normuon,dion3-1/2", "--json", str(path)])
    assert code == 0
    rows = json.loads(path.read_text())["results"]
    assert [("error" in r) for r in rows] == [False, True, False]
    assert "out of memory (simulated)" in rows[1]["error"] and rows[1]["speedup"] is None
    assert "error: RuntimeError: out of memory (simulated)" in capsys.readouterr().out


def test_command_line_errors():
    with pytest.raises(SystemExit):
        step.main(["--device", "cpu", "--graph", "--shapes", "8x8"])  # capture needs CUDA
    with pytest.raises(SystemExit):
        step.main(["--device", "cpu", "--shapes", "8x8", "--steps", "0"])
    args = step.parse_args(["--device", "cpu", "--shapes", "8x8", "--skip", "adamw,muon"])
    assert "adamw" not in [v.name for v in args.variants] and not args.graph


def test_ns_coefficients_reach_every_orthogonalizing_variant_and_its_cost(tmp_path, capsys):
    """--ns-coefficients polar_express_4: every Muon/NorMuon/Dion3 variant (the baseline too) builds
    its groups with the schedule and is priced at 4 steps; AdamW keeps none; the report and the
    header name it; an unknown name is refused."""
    argv = ["--device", "cpu", "--no-graph", "--shapes", "16x64:2,64x16", "--optimizers",
            "adamw,muon,normuon,dion3-1/4,dion3-1/2-cost"]
    four = step.parse_args(argv + ["--ns-coefficients", "polar_express_4"])
    assert [v.ns_coefficients for v in four.variants] == ["polar_express"] + ["polar_express_4"] * 4
    default = step.parse_args(argv)
    assert all(v.ns_coefficients == "polar_express" for v in default.variants)
    device = torch.device("cpu")
    for variant, five in zip(four.variants[1:], default.variants[1:]):
        matrices, scalars = step.make_parameters(four.source, device, False)
        optimizer = step.make_optimizer(variant, matrices, scalars, device, False)
        assert {g["ns_coefficients"] for g in optimizer.param_groups} == {"polar_express_4"}
        flops_four = step.cost_of(variant, four.source, device, False).dense_flops
        flops_five = step.cost_of(five, default.source, device, False).dense_flops
        if variant.orthogonalizer == "newton_schulz":  # the baseline: 4 of 5 equal steps
            assert flops_four * 5 == flops_five * 4
        elif variant.allocation == "uniform":  # Gram NS: 4 steps, one restart, fewer products
            assert flops_four < flops_five
    out = tmp_path / "four.json"
    assert step.main(argv[:-2] + ["--optimizers", "muon", "--steps", "1", "--warmup", "1",
                                  "--ns-coefficients", "polar_express_4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ns_coefficients"] == "polar_express_4"
    assert report["results"][0]["variant"]["ns_coefficients"] == "polar_express_4"
    assert "Newton–Schulz polar_express_4 (4 steps)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        step.parse_args(argv + ["--ns-coefficients", "fast"])


def test_only_the_cublas_baseline_runs_with_kernels_off(monkeypatch):
    from dion3 import kernels

    seen = {}

    def record(variant, *args, **kwargs):
        seen[variant.name] = kernels.kernels_enabled()
        return {"device_ms": 1.0}

    monkeypatch.setattr(step, "measure", record)
    before = kernels.kernels_enabled()
    step.main(["--device", "cpu", "--shapes", "8x8", "--optimizers", "muon,muon-gram,dion3-1/4"])
    assert seen == {"muon": False, "muon-gram": before, "dion3-1/4": before}
    assert kernels.kernels_enabled() == before


def test_kernel_bench_rows_print_graph_timing_or_say_it_is_missing():
    """`dion3 bench kernels` reports GPU time alone from CUDA-graph replays; where a call cannot
    be captured (here: no CUDA at all) it warns and the eager figures still print."""
    from dion3.tools.bench import kernel_time as kernel_bench

    with pytest.warns(RuntimeWarning, match="no CUDA-graph timing"):
        assert kernel_bench._graph_ms_or_none(lambda: None) is None
    row = dict(shape="A·Aᵀ 8192×8192", config=None, path="hopper", tiling=dict(block_n=256, stages=4),
               cublas_ms=1.41, ours_ms=0.865, effective_tflops=1272.0, speedup=1.41 / 0.865,
               ours_max_rel_err=3.7e-3, cublas_max_rel_err=3.7e-3, graph_speedup=1.623 / 0.811,
               graph_effective_tflops=2 * 8192 ** 3 / 0.811 / 1e9)
    line = kernel_bench._format_symmetric(row)
    assert "gluon 128x256 ws s4" in line and "x1.63" in line and "graph x2.00 (1356)" in line
    row.update(graph_speedup=None, graph_effective_tflops=None)
    assert "graph n/a" in kernel_bench._format_symmetric(row)
    assert kernel_bench._ratio(3.0, None) is None and kernel_bench._ratio(3.0, 2.0) == 1.5


def test_dion3_version_prints_the_package_version(capsys):
    import dion3

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"dion3 {dion3.__version__} (torch ")


@pytest.mark.parametrize("command", ["bench", "bench kernels", "plan", "compare"])
def test_every_help_text_states_its_first_paragraph_whole(command, capsys):
    """--help shows the command's description whole: the first paragraph of its module's
    docstring, not a line cut mid-sentence."""
    import importlib

    module = importlib.import_module(cli.COMMANDS[command][0])
    with pytest.raises(SystemExit) as done:
        cli.main(command.split() + ["--help"])
    assert done.value.code == 0
    printed = " ".join(capsys.readouterr().out.split())
    paragraph = " ".join(module.__doc__.split("\n\n")[0].split())
    assert paragraph in printed, (paragraph, printed[:400])
    assert paragraph.rstrip().endswith((".", ":", ")")), paragraph


def test_eager_ab_alternates_two_trees_with_an_adamw_group(tmp_path):
    """benchmarks/eager_ab.py (the A/B behind the records): both trees load into one process and
    step in turns; --scalars adds the preset's embedding, head and norms as an AdamW group, at
    --vocab rows. The same tree twice: both sides step the same parameters' counts."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "ab.json"
    command = [sys.executable, "benchmarks/eager_ab.py", "--trees", "src", "src", "--preset", "cpu-small", "--device", "cpu",
               "--optimizers", "dion3-1/4", "--turns", "2", "--steps", "1", "--warmup", "1", "--scalars", "--vocab", "512",
               "--json", str(out)]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    preset = PRESETS["cpu-small"]
    assert record["meta"]["scalars"] == [
        {"name": "embedding,lm_head", "shape": [512, preset.matrices[0].cols], "count": 2},
        {"name": "rmsnorm", "shape": [preset.matrices[0].cols], "count": 2 * 4 + 1}]
    row = record["results"]["dion3-1/4"]
    assert len(row["A"]["wall_ms_all"]) == len(row["B"]["wall_ms_all"]) == 2 and row["wall_ratio"] > 0
    failed = subprocess.run(command[:-5] + ["--vocab", "512"], cwd=root, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2 and "--vocab sets the embedding's rows: use it with --scalars" in failed.stderr
    # a tree folder without dion3/ would import the installed package and time it on both sides
    wrong = [c if c != "src" else str(tmp_path) for c in command]
    refused = subprocess.run(wrong[:7] + ["--turns", "1"], cwd=root, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and f"--trees: {tmp_path} holds no dion3/__init__.py" in refused.stderr


def test_gpu_job_keeps_the_compile_cache_for_the_next_machine(tmp_path):
    """benchmarks/gpu_job.sh with CORPUS=0: COMMAND sees TORCHINDUCTOR_CACHE_DIR under DION3_CACHE,
    what it leaves there comes back in COMPILE_CACHE_TO, and a later job on an empty DION3_CACHE
    (a fresh machine) finds it there again from COMPILE_CACHE_FROM; COMMAND's outputs and exit
    status go through as before."""
    import subprocess
    import tarfile

    root = Path(__file__).resolve().parent.parent
    cache = tmp_path / "cache.tgz"

    def job(name, command, **env):
        archive = tmp_path / f"{name}.tgz"
        done = subprocess.run(["bash", "benchmarks/gpu_job.sh", str(archive), command], cwd=root, timeout=120,
                              env={**__import__("os").environ, "CORPUS": "0", "DION3_CACHE": str(tmp_path / name), **env},
                              capture_output=True, text=True)
        return done.returncode, tarfile.open(archive)

    status, packed = job("first", 'echo kernel > "$TORCHINDUCTOR_CACHE_DIR/k.bin"; echo run > "$WORK/out.txt"; exit 3',
                         COMPILE_CACHE_TO=str(cache))
    assert status == 3 and packed.extractfile("./out.txt").read() == b"run\n"
    assert "./k.bin" in tarfile.open(cache).getnames()
    status, packed = job("second", 'cp "$TORCHINDUCTOR_CACHE_DIR/k.bin" "$WORK/found.txt"', COMPILE_CACHE_FROM=str(cache))
    assert status == 0 and packed.extractfile("./found.txt").read() == b"kernel\n"
    assert f"compile cache: from {cache}" in packed.extractfile("./machine.txt").read().decode()


def test_regime_jobs_plan_their_runs_through_the_study(tmp_path):
    """benchmarks/regime_jobs.sh --dry-run: the study itself plans each run of a named job (the
    flags parse, the settings are the ones the job names); an unknown job is refused naming the jobs."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    # the interpreter running the tests (a venv need not be activated: `python` on PATH may be another)
    env = {**__import__("os").environ, "WORK": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "benchmarks/regime_jobs.sh", "--dry-run", "b128-edges"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    planned = sorted(line.split("to run  ", 1)[1] for line in done.stdout.splitlines() if "to run  " in line)
    assert planned == sorted([
        "dion3-3/8-cost lr=0.015 mu=0.6 h=1500 seed=0", "dion3-1/4-cost lr=0.02 mu=0.6 h=1500 seed=0",
        "dion3-1/2-cost lr=0.02 mu=0.6 h=1500 seed=0", "normuon lr=0.01 mu=0.6 h=1500 seed=0",
        "muon lr=0.02 mu=0.9 h=1500 seed=0"])
    assert all("(batch 128)" in line for line in done.stdout.splitlines() if "to run" in line)
    refused = subprocess.run(["bash", "benchmarks/regime_jobs.sh", "b512"], cwd=root, env=env, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "unknown job 'b512'" in refused.stderr and "b128-edges" in refused.stderr


def _run_job_with_stand_in(tmp_path, job: str, study_lines: str):
    """Run regime_jobs.sh JOB with a stand-in $PYTHON: `-m dion3.tools.study` appends its arguments
    to $WORK/calls.txt, then runs study_lines (bash); any other call goes to this interpreter.
    Returns (the finished job, $WORK, the study calls in order)."""
    import os
    import subprocess
    import sys

    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text(
        "#!/bin/bash\n"
        'if [ "$2" = dion3.tools.study ]; then\n'
        '  echo "$@" >> "$WORK/calls.txt"\n'
        f"{study_lines}"
        "  exit 0\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n')
    (shim / "python").chmod(0o755)
    work = tmp_path / "work"
    env = {**os.environ, "WORK": str(work), "PYTHON": str(shim / "python")}
    done = subprocess.run(["bash", "benchmarks/regime_jobs.sh", job], cwd=Path(__file__).resolve().parent.parent,
                          env=env, capture_output=True, text=True, timeout=120)
    return done, work, (work / "calls.txt").read_text().splitlines()


def test_a_failed_run_fails_its_regime_job(tmp_path):
    """Outside --dry-run a job starts every run at once and waits for all: with a stand-in $PYTHON
    whose study fails for one run, the job still waits for the others and exits 1; each run gets its
    batch's validation windows (--eval-batches 2 at batch 256) and its own folder under $WORK."""
    done, work, calls = _run_job_with_stand_in(tmp_path, "b256-grid", '  case "$*" in *--muon-lr\\ 0.04*) exit 1 ;; esac\n')
    assert done.returncode == 1, done.stderr
    assert len(calls) == 3 and all("--batch-size 256 --eval-batches 2" in call for call in calls)
    assert sorted(call.split("--out ")[1] for call in calls) == sorted(
        str(work / name) for name in ("b256-muon-0.02", "b256-muon-0.04", "b256-half-0.03"))


def test_an_alone_job_runs_one_study_at_a_time(tmp_path):
    """The b128-alone jobs give the GPU to one process: the second run starts only after the first
    has ended (the stand-in study counts the calls begun when it ends), and a first run that fails
    still fails the job after the second has run."""
    done, work, calls = _run_job_with_stand_in(
        tmp_path, "b128-alone-a",
        "  sleep 1\n"  # a second run started beside this one would have written its call by now
        '  echo "$(wc -l < "$WORK/calls.txt")" >> "$WORK/begun_at_end.txt"\n'
        '  case "$*" in *--muon-lr*) exit 1 ;; esac\n')
    assert done.returncode == 1, done.stderr
    assert [call.split("--out ")[1] for call in calls] == [
        str(work / "b128-alone-muon-s0"), str(work / "b128-alone-normuon-s1")]
    assert "--seeds 0" in calls[0] and "--seeds 1" in calls[1]
    assert (work / "begun_at_end.txt").read_text().split() == ["1", "2"]
