"""Shared fixtures: deterministic seeding and an exact orthogonalizer for the optimizers."""

import pytest
import torch

import dion3.rules as rules_module
from reference import exact_padded_polar


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def one_thread():
    """The tests use small tensors: on a 2-core CI machine extra OpenMP threads only wait for
    each other and make them many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def exact_orthogonalizer(monkeypatch):
    """Make the optimizers use the float64 SVD polar factor, so that an optimizer step can be
    compared sharply with the float64 reference without depending on Newton–Schulz accuracy.
    Yields the call counter: a test that sees zero calls would be testing nothing."""
    calls = {"count": 0}

    def polar(x, *args, **kwargs):
        calls["count"] += 1
        return exact_padded_polar(x)

    monkeypatch.setattr(rules_module, "orthogonalize_padded", polar)
    yield calls
    assert calls["count"] > 0, "the optimizer never called the patched orthogonalizer"
