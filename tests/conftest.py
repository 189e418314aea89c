"""Shared fixtures: deterministic seeding and an exact orthogonalizer for the optimizers."""
import pytest
import torch

import dion3.rules as rules_module
from reference import exact_polar


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.fixture
def exact_orthogonalizer(monkeypatch):
    """Make the optimizers use the float64 SVD polar factor, so that an optimizer step can be
    compared sharply with the float64 reference without depending on Newton–Schulz accuracy.
    Yields the call counter: a test that sees zero calls would be testing nothing."""
    calls = {"count": 0}

    def polar(x, *args, **kwargs):
        calls["count"] += 1
        return exact_polar(x).to(x.dtype)

    monkeypatch.setattr(rules_module, "orthogonalize", polar)
    yield calls
    assert calls["count"] > 0, "the optimizer never called the patched orthogonalizer"
