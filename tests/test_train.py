"""Training demo: data sources, model shapes, parameter groups, a short run, `dion3 compare`."""
from __future__ import annotations

import csv
import json
import math
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dion3 import Dion3, Muon, NorMuon, param_groups
from dion3.tools.train import compare, data
from dion3.tools.train.model import GPT, GPTConfig, padded_vocab
from dion3.optim.graph import to_device_scalars
from dion3.tools.train import trainer
from dion3.tools.train.trainer import RunSpec, Schedule, resolve_device, train, use_captured_step

TINY = GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny matrices gain nothing from threads, and on a busy 2-core CI machine OpenMP threads
    # that wait for each other make these tests many times slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _write_raw_shard(path, header_values, tokens):
    header = np.zeros(256, dtype="<i4")
    header[: len(header_values)] = header_values
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())


# ----------------------------------------------------------------------------- data
def test_stdlib_default_is_bytes_with_a_stable_file_order_and_split():
    root, files = data.stdlib_files()
    names = [f.relative_to(root).as_posix() for f in files]
    assert names == sorted(names) and "os.py" in names
    assert not any(part in ("site-packages", "test") for n in names for part in n.split("/")[:-1])
    loaded = data.load_data()
    assert loaded.vocab_size == 256
    assert loaded.train.dtype == torch.long and 0 <= int(loaded.train.min()) and int(loaded.train.max()) < 256
    # Independent reconstruction of the split from the documented rule (CRC-32 of the relative path).
    import zlib

    val_names = [n for n in names if zlib.crc32(n.encode()) % 10_000 < 500]
    val_bytes = sum((root / n).stat().st_size for n in val_names)
    assert loaded.val.numel() == val_bytes
    assert loaded.train.numel() + loaded.val.numel() == sum(f.stat().st_size for f in files)
    first = (root / names[0]).read_bytes()
    if names[0] not in val_names:
        assert bytes(loaded.train[: len(first)].to(torch.uint8).tolist()) == first


def test_text_files_and_directories(tmp_path):
    texts = {f"doc{i}.txt": (f"document {i} " * 40).encode() for i in range(30)}
    (tmp_path / "sub").mkdir()
    for name, body in texts.items():
        (tmp_path / "sub" / name).write_bytes(body)
    from_dir = data.load_data(tmp_path)
    total = sum(len(b) for b in texts.values())
    assert from_dir.vocab_size == 256
    assert from_dir.train.numel() + from_dir.val.numel() == total
    assert from_dir.val.numel() > 0 and from_dir.train.numel() > 0
    # The same files listed in another order give the same split.
    listed = data.load_data([tmp_path / "sub" / n for n in reversed(list(texts))])
    assert listed.train.numel() + listed.val.numel() == total
    single = data.load_data(tmp_path / "sub" / "doc3.txt")  # one file: tail held out
    body = texts["doc3.txt"]
    cut = int(len(body) * 0.95)
    assert bytes(single.train.to(torch.uint8).tolist()) == body[:cut]
    assert bytes(single.val.to(torch.uint8).tolist()) == body[cut:]


def test_token_shards_round_trip_and_val_shards(tmp_path):
    rng = np.random.default_rng(0)
    train_tokens = rng.integers(0, 50257, size=1000)
    val_tokens = rng.integers(0, 50257, size=300)
    data.write_shard(tmp_path / "fineweb_train_000001.bin", train_tokens)
    _write_raw_shard(tmp_path / "fineweb_val_000000.bin", [20240520, 1, 300], val_tokens)
    loaded = data.load_data(tmp_path)
    assert loaded.vocab_size == 50257 and padded_vocab(loaded.vocab_size) == 50304
    assert loaded.train.tolist() == train_tokens.tolist()
    assert loaded.val.tolist() == val_tokens.tolist()
    only_train = data.load_data(tmp_path / "fineweb_train_000001.bin")  # no val shard: tail split
    assert only_train.train.tolist() + only_train.val.tolist() == train_tokens.tolist()
    assert only_train.val.numel() == 1000 - int(1000 * 0.95)


@pytest.mark.parametrize(
    "header, tokens, message",
    [
        ([123, 1, 4], [1, 2, 3, 4], "bad magic"),
        ([20240520, 7, 4], [1, 2, 3, 4], "unsupported version"),
        ([20240520, 1, 9], [1, 2, 3, 4], "header says 9 tokens"),
        ([20240520, 1, 2], [1, 60000], "outside the GPT-2 vocabulary"),
    ],
)
def test_malformed_shards_raise_clear_errors(tmp_path, header, tokens, message):
    path = tmp_path / "bad.bin"
    _write_raw_shard(path, header, tokens)
    with pytest.raises(ValueError, match=message):
        data.load_data(path)


def test_bad_paths_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_data(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files found"):
        data.load_data(tmp_path / "empty")
    (tmp_path / "short.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="shorter than its 1024-byte header"):
        data.load_data(tmp_path / "short.bin")
    (tmp_path / "a.txt").write_text("x" * 100)
    with pytest.raises(ValueError, match="mixing"):
        data.load_data([tmp_path / "a.txt", tmp_path / "short.bin"])
    (tmp_path / "one.txt").write_text("x")
    with pytest.raises(ValueError, match="split is empty"):
        data.load_data(tmp_path / "one.txt")


def test_batches_are_shifted_windows_and_reproducible():
    tokens = torch.arange(1000)
    first = next(data.train_batches(tokens, 4, 8, seed=3))
    again = next(data.train_batches(tokens, 4, 8, seed=3))
    inputs, targets = first
    assert torch.equal(inputs, again[0]) and inputs.shape == (4, 8)
    assert torch.equal(targets, inputs + 1)  # next-token targets on a counting sequence
    val = data.val_batches(tokens, 4, 8, num_batches=2)
    assert len(val) == 2 and int(val[-1][1].max()) == 999  # reaches the end of the split
    with pytest.raises(ValueError, match="fewer than seq_len"):
        data.val_batches(torch.arange(5), 1, 8, 1)


# ----------------------------------------------------------------------------- model
def test_model_shapes_causality_and_config_errors():
    torch.manual_seed(0)
    model = GPT(TINY)
    tokens = torch.randint(0, 256, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 256)
    loss = model(tokens, tokens).detach()
    assert loss.dim() == 0
    # lm_head starts at zero, so the first loss is exactly log(vocab).
    assert math.isclose(float(loss), math.log(256), rel_tol=1e-6)
    nn.init.normal_(model.lm_head.weight, std=0.1)
    for block in model.blocks:
        nn.init.normal_(block.attn.proj.weight, std=0.1)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-5)  # causal: the past ignores the future
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(d_model=30, n_head=4)


# ----------------------------------------------------------------------------- groups
def test_param_groups_place_every_parameter_exactly_once():
    model = GPT(TINY)
    model.extra_bias = nn.Parameter(torch.zeros(5))
    groups = param_groups(model, lm_head="lm_head", algorithm="muon", lr=0.05, fraction=0.5)
    placed = [id(p) for g in groups for p in g["params"]]
    assert sorted(placed) == sorted(id(p) for p in model.parameters())
    def is_head(group):
        return any(p is model.lm_head.weight for p in group["params"])

    by_kind = {g["algorithm"] + ("-head" if is_head(g) else ""): g for g in groups}
    matrices = {id(p) for p in by_kind["muon"]["params"]}
    expected = {id(p) for n, p in model.named_parameters() if p.dim() == 2 and n not in ("embed.weight", "lm_head.weight")}
    assert matrices == expected and by_kind["muon"]["lr"] == 0.05 and by_kind["muon"]["fraction"] == 0.5
    assert by_kind["adamw-head"]["params"] == [model.lm_head.weight]
    scalar_ids = {id(p) for g in groups if g["algorithm"] == "adamw" for p in g["params"]}
    assert id(model.embed.weight) in scalar_ids and id(model.extra_bias) in scalar_ids
    Dion3(groups)  # the optimizer accepts them
    # A module object works as well as a name; a tied head is placed once.
    model.lm_head.weight = model.embed.weight
    tied = param_groups(model, lm_head=model.lm_head)
    assert sorted(id(p) for g in tied for p in g["params"]) == sorted(id(p) for p in model.parameters())


def test_param_groups_never_guess_the_head():
    model = GPT(TINY)
    # no head named, but one that projects onto the embedding's vocabulary: refused, by its name
    with pytest.raises(ValueError, match="lm_head=None means the model has no LM head, but 'lm_head' projects"):
        param_groups(model)
    with pytest.raises(ValueError, match="names no module or parameter"):
        param_groups(model, lm_head="head")
    with pytest.raises(ValueError, match="not part of the model"):
        param_groups(model, lm_head=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        param_groups(model, lm_head="lm_head", algorithm="sgd")


def test_a_model_without_an_lm_head_needs_none():
    """lm_head=None (the default) means no head: an encoder whose last layer is not vocabulary-sized
    gets its matrices orthogonalized and its embedding in AdamW; lm_head=False keeps a
    vocabulary-sized layer a matrix on purpose."""
    encoder = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    groups = param_groups(encoder, lr=0.02)
    assert [g.get("algorithm") for g in groups] == [None, "adamw", "adamw"]
    assert groups[0]["param_names"] == ["1.weight", "3.weight"] and groups[1]["param_names"] == ["0.weight"]
    Dion3(groups)
    model = GPT(TINY)
    groups = param_groups(model, lm_head=False)
    assert "lm_head.weight" in groups[0]["param_names"]


def test_param_groups_name_every_parameter_in_errors():
    """Groups from param_groups carry the parameters' names, so an error names the parameter."""
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 0, bias=False))
    with pytest.raises(ValueError, match="parameter '1.weight' is empty"):
        Dion3(param_groups(model))


@pytest.mark.parametrize("named", [None, "dion3"])
def test_param_groups_leave_the_algorithm_to_the_optimizer_class(exact_orthogonalizer, named):
    """The same param_groups(...) under Muon, NorMuon and Dion3 run three algorithms: each class's
    matrices follow the float64 reference of its own rule, the AdamW groups follow torch's AdamW,
    and the three trajectories differ. An algorithm named in param_groups runs under every class."""
    from reference import ReferenceOptimizer

    hyper = dict(lr=0.05, mu=0.9, fraction=0.5)
    finals = {}
    for cls in (Muon, NorMuon, Dion3):
        torch.manual_seed(1)
        model = GPT(TINY).double()
        groups = param_groups(model, lm_head="lm_head", algorithm=named, **hyper)
        assert ("algorithm" in groups[0]) == (named is not None)
        optimizer = cls(groups)
        runs = {"muon": Muon, "normuon": NorMuon, "dion3": Dion3}
        algorithm = named or {value: key for key, value in runs.items()}[cls]
        assert optimizer.param_groups[0]["algorithm"] == algorithm
        matrices = optimizer.param_groups[0]["params"]
        reference = ReferenceOptimizer(matrices, algorithm, weight_decay=0.01, **hyper)
        scalar_groups = optimizer.param_groups[1:]
        others = [p for g in scalar_groups for p in g["params"]]
        twin_groups = [dict(params=[p.detach().clone().requires_grad_() for p in g["params"]], lr=g["lr"],
                            weight_decay=g["weight_decay"]) for g in scalar_groups]
        twins = [p for g in twin_groups for p in g["params"]]
        adamw = torch.optim.AdamW(twin_groups, betas=(0.9, 0.95), eps=1e-8)
        for _ in range(3):
            grads = [torch.randn_like(p) for p in matrices + others]
            for p, g in zip(matrices + others + twins, grads + grads[len(matrices):]):
                p.grad = g.clone()
            optimizer.step()
            reference.step(grads[: len(matrices)])
            adamw.step()
        for p, expected in zip(matrices, reference.params):
            torch.testing.assert_close(p.detach(), expected, rtol=2e-6, atol=2e-7)
        for p, twin in zip(others, twins):  # dion3's AdamW keeps its step count (bias correction) in float32
            torch.testing.assert_close(p.detach(), twin.detach(), rtol=1e-6, atol=1e-8)
        finals[cls] = torch.cat([p.detach().flatten() for p in matrices])
    gaps = [(finals[a] - finals[b]).abs().max().item() for a, b in ((Muon, NorMuon), (Muon, Dion3), (NorMuon, Dion3))]
    if named is None:
        assert min(gaps) > 1e-3  # three algorithms, three trajectories
    else:
        assert max(gaps) == 0.0  # the named algorithm, whatever the class


# ----------------------------------------------------------------------------- training
def _periodic_text(length: int) -> torch.Tensor:
    pattern = b"def add(a, b):\n    return a + b\n\n"
    return torch.tensor(list((pattern * (length // len(pattern) + 1))[:length]))


@pytest.mark.parametrize("algorithm, lr, fraction", [("dion3", 0.04, 0.25), ("adamw", 0.01, None)])
def test_short_training_run_lowers_the_loss(algorithm, lr, fraction):
    tokens = _periodic_text(4000)
    corpus = data.TokenData(tokens[:3000], tokens[3000:], 256, "periodic")
    schedule = Schedule(steps=24, batch_size=8, eval_every=8, eval_batches=2)
    result = train(RunSpec("run", algorithm, lr, fraction), TINY, schedule, corpus, torch.device("cpu"))
    assert result.eval_steps == [0, 8, 16, 24]
    assert result.val_losses[0] == pytest.approx(math.log(256), rel=1e-5)
    assert result.val_losses[-1] < 0.6 * result.val_losses[0]
    assert sum(result.train_losses[-5:]) < sum(result.train_losses[:5])
    assert result.optimizer_ms > 0 and result.total_ms > result.optimizer_ms


def test_same_seed_gives_identical_runs():
    tokens = _periodic_text(3000)
    corpus = data.TokenData(tokens[:2500], tokens[2500:], 256, "periodic")
    schedule = Schedule(steps=4, batch_size=4, eval_every=2, eval_batches=1)
    runs = [train(RunSpec("m", "muon", 0.02), TINY, schedule, corpus, torch.device("cpu"), seed=5) for _ in range(2)]
    assert runs[0].train_losses == runs[1].train_losses and runs[0].val_losses == runs[1].val_losses


def test_compiled_run_follows_the_eager_run():
    """compiled=True sends forward and backward through torch.compile (the study's --compile):
    the same math, so on the CPU in float32 the losses follow the eager run's closely, and the
    optimizer still updates the model's own parameters (the trained losses fall)."""
    tokens = _periodic_text(3000)
    corpus = data.TokenData(tokens[:2500], tokens[2500:], 256, "periodic")
    schedule = Schedule(steps=3, batch_size=4, eval_every=3, eval_batches=1)
    spec = RunSpec("d", "dion3", 0.04, 0.25, 0.6)
    eager = train(spec, TINY, schedule, corpus, torch.device("cpu"), seed=3)
    compiled = train(spec, TINY, schedule, corpus, torch.device("cpu"), seed=3, compiled=True)
    assert compiled.train_losses == pytest.approx(eager.train_losses, rel=1e-4)
    assert compiled.val_losses == pytest.approx(eager.val_losses, rel=1e-4)
    assert compiled.val_losses[-1] < compiled.val_losses[0]


@pytest.mark.parametrize("algorithm", ["dion3", "muon"])
def test_a_run_records_the_steps_whose_updates_were_skipped(algorithm, monkeypatch):
    """Orthogonalizations return NaN during steps 2 and 4 only: the guard skips those matrices and the
    run records exactly those steps, with the counter's total."""
    from dion3 import rules

    from reference import altered_orthogonalizer

    faulty_steps, step = {2, 4}, [0]
    faulty = altered_orthogonalizer(lambda out: torch.full_like(out, float("nan")) if step[0] in faulty_steps else out)

    def count_step():
        step[0] += 1

    monkeypatch.setattr(rules, "orthogonalize_padded", faulty)
    tokens = _periodic_text(3000)
    corpus = data.TokenData(tokens[:2500], tokens[2500:], 256, "periodic")
    schedule = Schedule(steps=6, batch_size=4, eval_every=6, eval_batches=1)
    result = train(RunSpec("r", algorithm, 0.02, 0.5 if algorithm == "dion3" else None), TINY, schedule, corpus,
                   torch.device("cpu"), on_step=count_step)
    matrices = 2 * 6  # per block: q, k, v, o, two MLP matrices; every one of them skipped at each faulty step
    assert result.skipped_update_steps == [2, 4] and result.nonfinite_updates == 2 * matrices
    assert result.nonfinite_parameters == 0 and all(math.isfinite(v) for v in result.train_losses)



def test_the_study_s_progress_lines_carry_the_updates_skipped_so_far(capsys):
    """A run whose gradients turn NaN at its third step: the guard skips every matrix then, and the
    progress line after it says how many (the log of a run that dies keeps that count)."""
    from dion3.tools.study.child import progress_printer

    built, step = {}, [0]
    printer = progress_printer(4, lines=2, skipped=lambda: int(built["optimizer"].nonfinite_updates) if built else None)

    def on_step():
        printer()
        step[0] += 1

    def poison(optimizer):
        built["optimizer"] = optimizer
        matrices = [p for group in optimizer.param_groups if group.get("algorithm") == "dion3" for p in group["params"]]
        built["matrices"] = len(matrices)
        for p in matrices:  # the third backward (step index 2) leaves NaN in every matrix's gradient
            p.register_hook(lambda grad: grad * float("nan") if step[0] == 2 else grad)

    tokens = _periodic_text(3000)
    corpus = data.TokenData(tokens[:2500], tokens[2500:], 256, "periodic")
    train(RunSpec("r", "dion3", 0.02, 0.5), TINY, Schedule(steps=4, batch_size=4, eval_every=4, eval_batches=1), corpus,
          torch.device("cpu"), on_step=on_step, on_optimizer=poison)
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert built["matrices"] == 2 * 6  # per block: q, k, v, o, two MLP matrices
    assert progress[0].startswith("step 2/4") and progress[0].endswith(", 0 updates skipped so far")
    assert progress[1].startswith("step 4/4") and progress[1].endswith(", 12 updates skipped so far")

def test_fraction_warmup_run_logs_its_average_fraction_and_step_times():
    """dion3 with a 2-step fraction warm-up to ¼ over 4 steps sets f = 1, ⅝, ¼, ¼ (mean 0.53125);
    the first losses match the fixed-fraction run's and the later ones do not."""
    tokens = _periodic_text(3000)
    corpus = data.TokenData(tokens[:2500], tokens[2500:], 256, "periodic")
    schedule = Schedule(steps=4, batch_size=4, eval_every=4, eval_batches=1)
    warm = train(RunSpec("w", "dion3", 0.04, 0.25, 0.3, fraction_warmup=2), TINY, schedule, corpus, torch.device("cpu"))
    fixed = train(RunSpec("f", "dion3", 0.04, 0.25, 0.3), TINY, schedule, corpus, torch.device("cpu"))
    muon = train(RunSpec("m", "muon", 0.02), TINY, schedule, corpus, torch.device("cpu"))
    assert warm.average_fraction == (1 + 0.625 + 0.25 + 0.25) / 4 and fixed.average_fraction == 0.25
    assert muon.average_fraction is None and warm.fraction_warmup == 2
    # the zero-initialized head gives the matrices no gradient at step 0: the fractions differ from step 1 on
    assert warm.train_losses[:2] == fixed.train_losses[:2] and warm.val_losses[-1] != fixed.val_losses[-1]
    assert warm.optimizer_ms_median > 0 and fixed.optimizer_ms_median > 0


def test_periodic_full_and_unselected_decay_runs_train_and_log_their_fractions():
    """full_every=2 over ¼: f = ¼, 1, ¼, 1, … (mean ⅝), the optimizer FLOPs of those fractions
    (between the fixed ¼ run's and Muon's), and the loss falls; unselected_decay=0.5 trains too and
    differs from the plain run once a step left rows unselected."""
    tokens = _periodic_text(4000)
    corpus = data.TokenData(tokens[:3000], tokens[3000:], 256, "periodic")
    schedule = Schedule(steps=8, batch_size=8, eval_every=8, eval_batches=2)
    full = train(RunSpec("p", "dion3", 0.04, 0.25, 0.3, full_every=2), TINY, schedule, corpus, torch.device("cpu"))
    fixed = train(RunSpec("f", "dion3", 0.04, 0.25, 0.3), TINY, schedule, corpus, torch.device("cpu"))
    decayed = train(RunSpec("d", "dion3", 0.04, 0.25, 0.3, unselected_decay=0.5), TINY, schedule, corpus,
                    torch.device("cpu"))
    assert full.average_fraction == 0.625 and full.fraction_range == (0.25, 1.0)
    assert fixed.optimizer_flops < full.optimizer_flops
    for result in (full, decayed):
        assert result.val_losses[-1] < 0.8 * result.val_losses[0]
        assert all(math.isfinite(v) for v in result.train_losses)
    assert decayed.average_fraction == 0.25 and decayed.train_losses != fixed.train_losses
    # the first full step is step 1: the losses before its update agree, the next one does not
    assert full.train_losses[:2] == fixed.train_losses[:2] and full.train_losses[2] != fixed.train_losses[2]


def test_compare_run_spec_names_with_a_fraction_warmup():
    preset = compare.PRESETS["cpu-tiny"]
    spec = compare.run_spec("dion3-1/4-warmup200", preset, {}, {})
    assert (spec.label, spec.algorithm, spec.fraction, spec.fraction_warmup) == ("dion3-1/4-warmup200", "dion3", 0.25, 200)
    assert (spec.lr, spec.mu) == (preset.lrs["dion3-1/4"], preset.mus["dion3-1/4"])  # its fraction's values
    spec = compare.run_spec("dion3-1/4-warmup50", preset, {"dion3-1/4-warmup50": 0.05}, {"dion3-1/4": 0.6})
    assert (spec.lr, spec.mu, spec.fraction_warmup) == (0.05, 0.6, 50)
    assert compare.run_spec("dion3-1/4", preset, {}, {}).fraction_warmup == 0
    for bad in ("dion3-1/4-warmup", "dion3-1/4-warmup0", "dion3-1/4-warmupx", "dion3-2-warmup10",
                "dion3-1/4-warmup10-cost", "dion3-cost", "dion3-0-cost", "dion3-f-cost", "dion3-f0-cost"):
        with pytest.raises(ValueError, match="--optimizers"):
            compare.run_spec(bad, preset, {}, {})
    # by cost: fixed per-shape fractions within f's modeled step time, with f's lr and μ unless named itself
    spec = compare.run_spec("dion3-1/4-cost", preset, {}, {"dion3-1/4-cost": 0.6})
    assert (spec.fraction, spec.fraction_allocation, spec.fraction_warmup) == (0.25, "cost", 0)
    assert (spec.lr, spec.mu) == (preset.lrs["dion3-1/4"], 0.6)
    assert compare.run_spec("dion3-1/4", preset, {}, {}).fraction_allocation == "uniform"


def test_compare_reads_the_old_names_as_the_same_settings():
    """Commands written before the one naming still run: dion3-f0.25, -warm200 and -cost name the
    settings dion3-1/4, -warmup200 and -cost, with the same lr, μ, fraction and allocation."""
    preset = compare.PRESETS["cpu-tiny"]
    for old, new in (("dion3-f0.25", "dion3-1/4"), ("dion3-f0.5-cost", "dion3-1/2-cost"),
                     ("dion3-f0.25-warm200", "dion3-1/4-warmup200"), ("dion3-0.25-cost", "dion3-1/4-cost"),
                     ("dion3-f1/8", "dion3-1/8")):
        assert compare.run_spec(old, preset, {}, {}) == compare.run_spec(new, preset, {}, {})
        assert compare.run_spec(old, preset, {}, {}).label == new


def test_compare_table_states_the_budget_and_each_matrix_fraction():
    """A ¼-by-cost run once read "average fraction 0.312" (the rows' average of its per-shape
    fractions) beside its name: the row now gives the budget as the name says it and the least and
    greatest fraction a matrix held, which the allocation itself (param_groups, on the same model)
    sets; a uniform fraction is one number, a warm-up spans 1 to its target, Muon every row."""
    tokens = _periodic_text(3000)
    corpus = data.TokenData(tokens[:2500], tokens[2500:], 256, "periodic")
    schedule = Schedule(steps=2, batch_size=2, eval_every=2, eval_batches=1)
    preset = compare.PRESETS["cpu-tiny"]
    names = ("adamw", "muon", "dion3-1/4", "dion3-1/4-cost", "dion3-1/4-warmup1")
    results = [train(compare.run_spec(name, preset, {}, {}), TINY, schedule, corpus, torch.device("cpu")) for name in names]
    lines = compare.summary_table(results, "nats per byte").splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {cells[0]: dict(zip(header, cells)) for cells in
            ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:])}
    assert list(rows) == list(names)
    with torch.device("meta"):
        model = GPT(GPTConfig(**{**TINY.__dict__, "vocab_size": padded_vocab(256)}))
    allocated = [g["fraction"] for g in param_groups(model, lm_head=model.lm_head, fraction=0.25,
                                                     fraction_allocation="cost") if g.get("algorithm") != "adamw"]
    # the shapes get different fractions (at d = 32 every k pads to 128 rows, so ¼'s time buys most rows)
    assert len(allocated) > 1 and min(allocated) < max(allocated)
    cost = rows["dion3-1/4-cost"]
    assert cost["fraction budget"] == "1/4 by cost"
    assert cost["fraction per matrix"] == f"{min(allocated):.3g}–{max(allocated):.3g}"
    # the rows' average of those fractions, what the old column showed, is in the record, not the table
    row_weighted = results[3].average_fraction
    assert row_weighted > 0.25 and f"{row_weighted:.3f}" not in lines[5] and f"{row_weighted:.3g}" not in lines[5]
    assert (rows["dion3-1/4"]["fraction budget"], rows["dion3-1/4"]["fraction per matrix"]) == ("1/4 on every matrix", "0.25")
    warm = rows["dion3-1/4-warmup1"]
    assert (warm["fraction budget"], warm["fraction per matrix"]) == ("1 → 1/4 over 1 step", "0.25–1")
    assert (rows["muon"]["fraction budget"], rows["muon"]["fraction per matrix"]) == ("—", "1")
    assert (rows["adamw"]["fraction budget"], rows["adamw"]["fraction per matrix"]) == ("—", "—")


def test_the_demo_says_where_its_settings_come_from():
    """The demo runs Dion3 at lr 0.042 / 0.08 and μ 0.3 where the README gives 0.02 and μ 0.6.
    Under its table it says that its values were tuned on the tiny model, by which record, and that
    the README's are the study models'; the record, commit and sections it names exist and say so."""
    preset = compare.PRESETS["cpu-tiny"]
    specs = [compare.run_spec(name, preset, {}, {}) for name in compare.DEFAULT_OPTIMIZERS]
    printed = compare.settings_note("cpu-tiny", preset, specs)
    assert printed in (ROOT / "docs" / "training.md").read_text()  # the docs show it as it prints
    note = " ".join(printed.split())  # as one line, unwrapped
    assert note.startswith("Settings of --preset cpu-tiny: tuned for this 1.7 M-parameter byte model")
    assert {(s.label, s.lr, s.mu) for s in specs if s.algorithm == "dion3"} == {
        ("dion3-1/2-cost", 0.042, 0.3), ("dion3-1/4-cost", 0.08, 0.3)}
    assert "Dion3 1/4 by cost: lr 0.08, the best of a 3-seed lr grid" in note and "μ 0.3" in note
    assert "Dion3 1/2's lr 0.042 is f = 1/4's lr of then (0.06) scaled by 1/√f, not swept" in note
    # the record of the grid, whose best is 0.08
    named = re.findall(r"benchmarks/results/[\w.-]+\.md", note)
    assert named == ["benchmarks/results/compare-cpu-tiny-2026-12-04.md"]
    assert "| **0.08** |" in (ROOT / named[0]).read_text()
    # the sections of docs/training.md it names: this model's sweeps, and the study's recommendations
    training = (ROOT / "docs" / "training.md").read_text()
    sections = re.findall(r'docs/training\.md, "([^"]+)"', note)
    assert set(sections) == {"Learning rates", "Horizon → recommended fraction schedule, lr, μ"}
    assert all(f"\n## {section}\n" in training for section in sections)
    assert "The README's lr 0.02 and μ 0.6 (Dion3 1/2, 3/8 and 1/4 by cost) are the study models' settings, chosen from their lr grids" in note
    assert "lr=0.02, mu=0.6, fraction=0.375" in (ROOT / "README.md").read_text() and "lr=0.02, mu=0.6, fraction=0.5" in training
    # every run takes the preset's values: nothing set on the command line, nothing extrapolated
    assert "command line" not in note and "no value of its own" not in note
    # the commit that tuned the first cpu-tiny model, where the history is at hand
    history = subprocess.run(["git", "log", "-1", "--format=%s", "a53f457"], cwd=ROOT, capture_output=True, text=True)
    if history.returncode == 0:
        assert "commit a53f457" in note and "tuned cpu-tiny learning rates and momenta" in history.stdout


def test_schedule_warmup_and_cooldown():
    schedule = Schedule(steps=100, batch_size=1, eval_every=10, eval_batches=1, warmup_steps=4, cooldown_fraction=0.5)
    values = [schedule.lr_multiplier(s) for s in range(100)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0] and values[49] == 1.0
    assert values[50] == pytest.approx(50 / 50) and values[99] == pytest.approx(1 / 50)


def test_device_selection():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="only 'cpu', 'cuda"):
        resolve_device("meta")
    with pytest.raises(ValueError, match="not a device name"):
        resolve_device("gpu0")


def test_captured_step_by_default_on_a_gpu_only():
    assert use_captured_step(torch.device("cuda")) and use_captured_step(torch.device("cuda:1"), eager=False)
    assert not use_captured_step(torch.device("cuda"), eager=True)
    assert not use_captured_step(torch.device("cpu")) and not use_captured_step(torch.device("cpu"), eager=True)


class FakeCapturedStep:
    """Stands in for CapturedStep on the CPU: it makes lr a device tensor as the real one does,
    and checks at every call that the trainer filled that same tensor with the scheduled lr."""

    instances: list = []

    def __init__(self, optimizer):
        self.optimizer, self.seen = optimizer, []
        to_device_scalars(optimizer, torch.device("cpu"))
        self.lr_tensors = [g["lr"] for g in optimizer.param_groups]
        FakeCapturedStep.instances.append(self)

    def __call__(self):
        groups = self.optimizer.param_groups
        assert all(g["lr"] is t for g, t in zip(groups, self.lr_tensors)), "lr tensor replaced: a graph would not see it"
        self.seen.append([float(g["lr"]) / g["initial_lr"] for g in groups])
        self.optimizer.step()


def test_trainer_drives_a_captured_step_through_device_lr_and_kept_gradients(monkeypatch):
    """The wiring of captured=True, run on the CPU with the graph faked: the step object is
    called once per step, the lr schedule reaches it through the same tensors, gradients are
    zeroed in place (the buffers a graph reads), and the run matches the eager one."""
    FakeCapturedStep.instances = []
    monkeypatch.setattr(trainer, "CapturedStep", FakeCapturedStep)
    tokens = _periodic_text(3000)
    corpus = data.TokenData(tokens[:2500], tokens[2500:], 256, "periodic")
    schedule = Schedule(steps=6, batch_size=4, eval_every=3, eval_batches=1, warmup_steps=2, cooldown_fraction=0.5)
    spec = RunSpec("d", "dion3", 0.04, 0.25)
    eager = train(spec, TINY, schedule, corpus, torch.device("cpu"), seed=3)
    captured = train(spec, TINY, schedule, corpus, torch.device("cpu"), seed=3, captured=True)
    (fake,) = FakeCapturedStep.instances
    expected = [schedule.lr_multiplier(step) for step in range(schedule.steps)]
    assert len(fake.seen) == schedule.steps
    for row, multiplier in zip(fake.seen, expected):  # every group, float32 lr tensors
        assert row == pytest.approx([multiplier] * len(row), rel=1e-6)
    assert all(p.grad is not None for g in fake.optimizer.param_groups for p in g["params"])
    assert captured.train_losses == pytest.approx(eager.train_losses, rel=1e-4)
    assert captured.val_losses == pytest.approx(eager.val_losses, rel=1e-4)


# ----------------------------------------------------------------------------- dion3 compare
class _Stop(Exception):
    pass


@pytest.mark.parametrize("device, flags, expected", [
    ("cuda", [], True), ("cuda", ["--eager"], False), ("cpu", [], False), ("cpu", ["--eager"], False),
])
def test_compare_captures_gpu_steps_unless_eager(tmp_path, monkeypatch, capsys, device, flags, expected):
    """The device is faked (no GPU needed): compare must hand train() captured=True on CUDA by
    default, False with --eager and always False on the CPU."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_bytes(bytes(_periodic_text(4000).tolist()))
    seen = {}

    def fake_train(*args, **kwargs):
        seen.update(device=args[4], captured=kwargs.get("captured"))
        raise _Stop

    monkeypatch.setattr(compare, "resolve_device", lambda requested: torch.device(device))
    monkeypatch.setattr(compare, "train", fake_train)
    with pytest.raises(_Stop):
        compare.main(["--optimizers", "muon", "--data", str(corpus), "--out", str(tmp_path / "out"), *flags])
    assert seen == {"device": torch.device(device), "captured": expected}
    assert ("captured optimizer steps" if expected else "eager optimizer steps") in capsys.readouterr().out


def test_compare_command_writes_table_logs_and_plot(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"f{i}.py").write_bytes(bytes(_periodic_text(700 + 13 * i).tolist()))
    tiny = compare.Preset(
        model=TINY, schedule=Schedule(steps=50, batch_size=4, eval_every=2, eval_batches=1),
        lrs={"adamw": 0.01, "muon": 0.02, "normuon": 0.02, "dion3-1/4": 0.04}, device="cpu",
    )
    monkeypatch.setitem(compare.PRESETS, "test-micro", tiny)
    out = tmp_path / "out"
    from dion3.tools.cli import main as cli_main

    code = cli_main([
        "compare", "--preset", "test-micro", "--steps", "3", "--data", str(corpus), "--out", str(out),
        "--optimizers", "adamw,muon,dion3-1/4,dion3-f0.5", "--lr", "muon=0.03", "--mu", "dion3-f0.25=0.6",
    ])
    assert code == 0
    printed = capsys.readouterr()
    for label in ("adamw", "muon", "dion3-1/4", "dion3-1/2"):  # dion3-f0.5 is the old spelling of dion3-1/2
        assert f"| {label} |" in printed.out
    assert "note: dion3-f0.5 is written dion3-1/2" in printed.err and "dion3-f0.5 |" not in printed.out
    assert "[muon] step     3/3" in printed.err  # plain progress lines when not a terminal
    summary = json.loads((out / "results.json").read_text())
    runs = {r["label"]: r for r in summary["runs"]}
    # --mu dion3-f0.25=... names dion3-1/4 in the old spelling
    assert runs["muon"]["lr"] == 0.03 and runs["dion3-1/4"]["mu"] == 0.6 and runs["muon"]["mu"] is None
    assert runs["dion3-1/2"]["lr"] == pytest.approx(0.04 * math.sqrt(0.5))  # f=¼'s lr scaled by 1/√f, the fallback
    assert all(r["eval_steps"] == [0, 2, 3] for r in runs.values())
    # Same seed, same initial model and validation set: identical loss before training.
    assert len({r["val_losses"][0] for r in runs.values()}) == 1
    with open(out / "history.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4 * 3 and {r["optimizer"] for r in rows} == set(runs)
    assert (out / "val_loss.png").read_bytes()[:4] == b"\x89PNG" and summary["settings"]["loss_unit"] == "nats per byte"
    assert (out / "summary.md").read_text().startswith("| optimizer |")
    assert "| fraction budget | fraction per matrix |" in printed.out and "| 1/4 on every matrix | 0.25 |" in printed.out
    # the loss in the unit the README gives it: the demo trains on bytes
    assert "| final val loss (nats per byte) |" in printed.out
    assert "| final val loss (nats per byte) |" in (out / "summary.md").read_text()
    # under the table, printed and in summary.md: where the settings come from, the values set on the
    # command line, and dion3-1/2's lr, which this preset does not give
    note = " ".join((out / "summary.md").read_text().split("\n\n", 1)[1].split())
    assert note.startswith("Settings of --preset test-micro: set in the preset, not tuned.")
    assert "- muon: lr 0.03 (preset: 0.02) set on the command line." in note
    assert "- dion3-1/4: μ 0.6 (preset: the optimizer's default) set on the command line." in note
    assert "- dion3-1/2: no value of its own in the preset: lr 0.0282843 is f = 1/4's lr scaled by 1/√f" in note
    assert "The README's lr 0.02 and μ 0.6" in note
    assert " ".join(printed.out.split()).count(note) == 1 and summary["settings"]["settings_source"].split() == note.split()



def test_the_plot_shows_every_curve_whole_in_nats_and_tells_the_runs_apart(tmp_path):
    """validation_figure: log-scale y-axes that span every evaluation (the untrained loss at step 0
    too), the unit in the y label, five runs of distinct colours and markers, each line style other
    than the run before's; the zoom panel holds the runs that end close to the best.
    plot_validation writes it as a PNG, and the module's command redraws a compare record's curves."""
    import matplotlib.pyplot as plt

    from dion3.tools.train import plot

    runs = []
    for i, (label, end) in enumerate([("adamw", 2.2), ("muon", 1.54), ("normuon", 1.545), ("dion3-f0.5", 1.53),
                                      ("dion3-f0.25", 1.538)]):
        steps = [0, 25, 50, 100, 150, 200]
        losses = [5.545] + [end + (2.4 - end) * (1 - s / 200) ** 2 for s in steps[1:]]
        runs.append(trainer.RunResult(label, label, 0.02, None, None, eval_steps=steps,
                                      eval_seconds=[s * (0.5 + 0.1 * i) for s in steps], val_losses=losses))
    figure = plot.validation_figure(runs, "test", "nats per byte")
    try:
        by_step, by_time, zoom = figure.axes
        for axis in (by_step, by_time):
            assert axis.get_yscale() == "log"
            low, high = axis.get_ylim()
            assert low <= 1.53 and high >= 5.545  # the whole curve, first evaluation included
            assert "nats per byte" in axis.get_ylabel()
            styles = [(line.get_color(), str(line.get_linestyle()), line.get_marker()) for line in axis.get_lines()]
            assert len(styles) == 5
            # every colour and marker its own; line styles differ between runs drawn one after another
            assert len({c for c, _, _ in styles}) == len({m for _, _, m in styles}) == 5, styles
            assert all(a[1] != b[1] for a, b in zip(styles, styles[1:])), styles
            assert [line.get_label() for line in axis.get_lines()] == [r.label for r in runs]
        assert "nats per byte" in zoom.get_ylabel()
        assert [line.get_label() for line in zoom.get_lines()] == ["muon", "normuon", "dion3-f0.5", "dion3-f0.25"]
        assert all(min(line.get_xdata()) >= 100 for line in zoom.get_lines())
    finally:
        plt.close(figure)
    assert plot.plot_validation(runs, tmp_path / "p.png", "test").read_bytes()[:4] == b"\x89PNG"
    assert plot.loss_unit(256) == "nats per byte" and plot.loss_unit(50257) == "nats per token"
    record = plot.Path(__file__).parents[1] / "benchmarks" / "results" / "compare-cpu-tiny-2026-12-04.json"
    loaded, settings = plot.load_results(record)
    # the record names the settings as compare did then (dion3-f0.5-cost): read as they are named now
    assert "dion3-f0.5-cost" in record.read_text() and "dion3-1/2-cost" not in record.read_text()
    assert [r.label for r in loaded] == list(compare.DEFAULT_OPTIMIZERS) and settings["preset"] == "cpu-tiny"
    assert [r.fraction_allocation for r in loaded if r.algorithm == "dion3"] == ["cost", "cost"]
    assert plot.main([str(record), str(tmp_path / "replot.png")]) == 0
    assert (tmp_path / "replot.png").read_bytes()[:4] == b"\x89PNG"

def test_compare_rejects_bad_options(tmp_path, capsys):
    assert compare.main(["--optimizers", "sgd", "--out", str(tmp_path)]) == 2
    assert "unknown optimizer 'sgd'" in capsys.readouterr().err
    assert compare.main(["--data", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert compare.main(["--optimizers", "muon", "--lr", "adamw=0.1", "--out", str(tmp_path)]) == 2
    assert "not among the optimizers being run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main(["--steps", "0"])


@pytest.mark.parametrize("flags, message", [
    (["--lr", "muon=-1"], "muon: parameter group 0: lr must be a finite number ≥ 0, got -1.0"),
    (["--mu", "dion3-f0.25=1.5"], "dion3-1/4: parameter group 0: mu must lie in [0.0, 1.0), got 1.5"),
])
def test_compare_refuses_a_bad_setting_before_any_run_trains(tmp_path, monkeypatch, capsys, flags, message):
    """The bad run is the last one: the check must come before the first run, not when its turn comes."""
    trained = []
    monkeypatch.setattr(compare, "train", lambda spec, *args, **kwargs: trained.append(spec.label))
    assert compare.main(["--optimizers", "adamw,muon,dion3-f0.25", *flags, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert trained == []
