"""benchmarks/skip_trace.py on CPU: the wrapper keeps each matrix the guard skips, with Newton–Schulz's
input, and names the cause. Muon's step goes through the same matrix step and guard as Dion3's, so a
Muon run shows both causes: a non-finite gradient entry, and an orthogonalization that fails."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from dion3 import Muon, rules

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("skip_trace", ROOT / "benchmarks" / "skip_trace.py")
skip_trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(skip_trace)


@pytest.fixture
def trace(tmp_path, monkeypatch):
    # the trace replaces two functions of dion3.rules; monkeypatch puts them back after the test
    monkeypatch.setattr(rules, "orthogonalize_rows", rules.orthogonalize_rows)
    monkeypatch.setattr(rules, "guard", rules.guard)
    kept = skip_trace.SkipTrace(str(tmp_path))
    kept.install()
    return kept


def _run(trace, steps, bad_step, poison):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 6)) for _ in range(2)]
    optimizer = Muon(params, lr=0.02)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(8, 6)
        if step == bad_step:
            poison(params[1])
        optimizer.step()
        trace.on_step(100)
    return params


def test_a_non_finite_gradient_is_kept_and_named(trace, tmp_path, capsys):
    def nan_entry(p):
        p.grad[2, 3] = math.nan

    params = _run(trace, 3, 1, nan_entry)
    assert (trace.step, trace.checked, trace.saved) == (3, 3, 1)
    (path,) = tmp_path.glob("skip_*.pt")
    assert path.name == "skip_1_0.pt"  # steps 0-based, as the study's skipped_update_steps: the second step
    record = torch.load(path, weights_only=False)
    assert record["bad"].tolist() == [1] and record["shape"] == (2, 8, 6)
    # the momentum pass keeps U finite and measures NaN for the poisoned row
    assert bool(torch.isfinite(record["u"]).all()) and not math.isfinite(float(record["norm"][0]))
    assert not bool(torch.isfinite(record["o"]).all())
    assert "caused by a non-finite gradient (U finite, its norm not)" in capsys.readouterr().out
    assert all(bool(torch.isfinite(p).all()) for p in params)  # the skip kept the weights finite


def test_a_failed_orthogonalization_is_told_from_a_bad_gradient(trace, tmp_path, monkeypatch, capsys):
    original = trace._orthogonalize
    calls = {"n": 0}

    def blown_up(update, method, coefficients, norm=None, normalized=False):
        out = original(update, method, coefficients, norm, normalized)
        calls["n"] += 1
        if calls["n"] == 2:  # the second step's O of matrix 1: far above any orthogonalization's norm
            out[1] = out[1] * 100
        return out

    trace._orthogonalize = blown_up
    _run(trace, 3, None, None)
    assert trace.saved == 1
    record = torch.load(next(tmp_path.glob("skip_*.pt")), weights_only=False)
    assert record["bad"].tolist() == [1] and float(record["o_norms"][1]) > record["limit"]
    assert "caused by the orthogonalization (U and its norm finite)" in capsys.readouterr().out


def test_the_cause_by_hand():
    finite = torch.ones(2, 3)
    assert skip_trace.cause(finite, torch.tensor(1.0)) == "the orthogonalization (U and its norm finite)"
    assert skip_trace.cause(finite, None) == "the orthogonalization (U and its norm finite)"
    assert skip_trace.cause(finite, torch.tensor(math.nan)) == "a non-finite gradient (U finite, its norm not)"
    assert skip_trace.cause(torch.tensor([[1.0, math.inf]]), torch.tensor(1.0)) == "a non-finite U"


def test_the_stop_is_raised_after_the_last_step(trace):
    trace.on_step(2)
    with pytest.raises(skip_trace.Stop):
        trace.on_step(2)


@pytest.mark.parametrize("argv, message", [
    (["--optimizer", "muon", "--lr", "0.02", "--fraction", "0.5", "--stop", "10", "--out", "x"], "--fraction is Dion3's"),
    (["--lr", "0.02", "--stop", "10", "--out", "x"], "--fraction is Dion3's"),
    (["--optimizer", "muon", "--lr", "0.02", "--mu", "0.8", "--batch-size", "0", "--stop", "10", "--out", "x"],
     "--batch-size must be ≥ 1"),
    (["--optimizer", "muon", "--lr", "0.02", "--stop", "0", "--out", "x"], "--stop must be in 1..1500"),
    (["--optimizer", "normuon", "--lr", "0.02", "--stop", "10", "--out", "x"], "--mu: give the μ of the normuon run"),
])
def test_bad_arguments_are_refused_by_name(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["skip_trace.py", *argv])
    with pytest.raises(SystemExit):
        skip_trace.main()
    assert message in capsys.readouterr().err
