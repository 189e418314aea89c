"""Regression tests for defects found in the final code review (one test per fix)."""
from __future__ import annotations

import pytest
import torch

from dion3 import Muon, NorMuon


def test_flatten_refuses_a_parameter_whose_rows_cannot_be_viewed_in_place():
    # A channels_last conv weight cannot be reshaped to [out, -1] without a copy: the optimizer
    # would update the copy and leave the parameter untouched. It must refuse it up front.
    conv = torch.nn.Conv2d(4, 8, 3, bias=False).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="flatten=True"):
        Muon([conv.weight], flatten=True)


def test_flatten_still_updates_a_contiguous_conv_weight_in_place():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4, 3, 3))
    before = weight.detach().clone()
    optimizer = Muon([weight], flatten=True, lr=0.1, weight_decay=0.0)
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    assert (weight - before).abs().max() > 1e-3


def test_muon_rejects_a_misspelled_keyword_instead_of_ignoring_it():
    weight = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(TypeError, match="nesterv"):
        Muon([weight], nesterv=True)
    with pytest.raises(TypeError, match="weight_decy"):
        NorMuon([weight], weight_decy=0.0)
    # settings of the other algorithms stay accepted (groups may switch algorithm)
    Muon([weight], fraction=0.5, muon_beta2=0.9, selection_scope="global")
