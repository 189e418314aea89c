"""A group added to a built optimizer (add_param_group) takes the constructor's defaults, as in
torch.optim, and is warned when those differ from what every other group of its algorithm runs;
settings it passes are honoured and silence the warning (docs/training.md, "Adding a group later").
The expected defaults are Dion3's documented signature values, written out here."""
from __future__ import annotations

import warnings

import pytest
import torch

import dion3
from dion3 import Dion3


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                               torch.nn.Linear(8, 24), torch.nn.Linear(24, 16))


def readme_optimizer(net):
    return Dion3(dion3.param_groups(net, lm_head="4", lr=0.015, mu=0.6, fraction=0.5, fraction_allocation="cost"))


def extra(name="extra.weight", shape=(8, 8)):
    return [(name, torch.nn.Parameter(torch.randn(*shape)))]


def test_a_group_added_later_takes_the_defaults_and_the_warning_says_what_to_pass():
    opt = readme_optimizer(model())
    matrix_groups = [g for g in opt.param_groups if g["algorithm"] == "dion3"]
    assert len(matrix_groups) == 2 and {g["lr"] for g in matrix_groups} == {0.015}
    fractions = sorted({g["fraction"] for g in matrix_groups})
    with pytest.warns(UserWarning) as caught:
        opt.add_param_group({"params": extra()})
    (warning,) = caught
    message = str(warning.message)
    added = opt.param_groups[-1]
    # torch semantics: Dion3's defaults (lr 0.01, μ 0.95, fraction 0.25), not the other groups' values
    assert (added["algorithm"], added["lr"], added["mu"], added["fraction"]) == ("dion3", 0.01, 0.95, 0.25)
    index = len(opt.param_groups) - 1
    assert message.startswith(f"parameter group {index} ('dion3') takes lr=0.01, mu=0.95, fraction=0.25 from the "
                              "defaults of this Dion3, but the other 'dion3' groups run lr=0.015, mu=0.6, fraction=")
    for fraction in fractions:  # the groups by cost hold different fractions: each is listed
        assert repr(fraction) in message
    assert "optimizer.add_param_group({'params': [...], 'lr': 0.015, 'mu': 0.6, 'fraction': ...})" in message
    assert warning.filename == __file__  # it points at the caller's line


def test_an_adamw_group_added_later_is_compared_with_the_adamw_groups():
    opt = readme_optimizer(model())
    # the groups: 0, 1 Dion3 by cost; 2 the head (lr 0.004); 3 the embedding and 4 the rest (lr 0.02)
    with pytest.warns(UserWarning, match=r"parameter group 5 \('adamw'\) takes lr=0.01 from the defaults of this Dion3, "
                      r"but the other 'adamw' groups run lr=0.004 \(group 2\) or 0.02 \(groups 3, 4\)"):
        opt.add_param_group({"params": extra("extra.bias", (8,)), "algorithm": "adamw"})
    # weight_decay 0.01 is not listed: some AdamW groups (embedding, head) run it too
    assert opt.param_groups[-1]["weight_decay"] == 0.01


@pytest.mark.parametrize("settings", [
    {"lr": 0.015, "mu": 0.6, "fraction": 0.5},
    {"lr": 0.01, "mu": 0.95, "fraction": 0.25},  # the defaults, passed on purpose
], ids=["the-others'", "the-defaults-explicit"])
def test_settings_passed_are_honoured_and_raise_no_warning(settings):
    net = model()
    opt = readme_optimizer(net)
    (name, w), = extra()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.add_param_group({"params": [(name, w)], **settings})
    reference_w = torch.nn.Parameter(w.detach().clone())
    reference = Dion3([reference_w], **settings)  # the same matrix alone, built with those settings
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        w.grad = torch.randn(w.shape, generator=gen)
        reference_w.grad = w.grad.clone()
        opt.step()
        reference.step()
    assert torch.equal(w, reference_w)


def test_the_constructor_s_groups_and_groups_like_the_others_raise_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = readme_optimizer(model())  # groups given to the constructor are the caller's choice
        w = torch.nn.Parameter(torch.randn(4, 4))
        plain = Dion3([w])
        plain.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 4))]})  # defaults like the others
        opt.add_param_group({"params": extra("scalar.bias", (8,)), "algorithm": "adamw", "lr": 0.02})


def test_the_lr_compared_is_the_one_a_scheduler_started_from():
    net = model()
    opt = readme_optimizer(net)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1)  # every group's lr is now a tenth of initial_lr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.add_param_group({"params": extra(), "lr": 0.015, "mu": 0.6, "fraction": 0.5})


def test_names_missing_from_a_group_added_later_are_asked_for_and_the_group_is_not_added():
    opt = readme_optimizer(model())
    count = len(opt.param_groups)
    with pytest.raises(ValueError, match=rf"parameter group {count} has no 'param_names'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(8, 8))], "lr": 0.015})
    assert len(opt.param_groups) == count
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt.add_param_group({"params": [w], "param_names": ["extra.weight"], "lr": 0.015, "mu": 0.6, "fraction": 0.5})
    assert opt.param_groups[-1]["param_names"] == ["extra.weight"]
    w.grad = torch.full_like(w, float("nan"))
    opt.check_finite = True
    with pytest.raises(FloatingPointError, match=rf"parameter 'extra.weight' of group {count}"):  # errors use the name
        opt.step()
