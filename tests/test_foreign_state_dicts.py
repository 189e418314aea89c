"""State dicts of torch.optim's own optimizers (AdamW, Adam, SGD, ...): `load_state_dict` refuses
them by name, `convert_state_dict` converts them as docs/training.md ("Switching from AdamW or
another torch optimizer") says. The reference for a conversion is a dion3 optimizer on a twin
model whose state is set by hand with the documented formulas (float64, rounded once): the next
steps must match it bit for bit."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

import dion3
from dion3 import Dion3, Muon, convert_state_dict

BETAS = (0.8, 0.99)  # not the defaults: β₁ must be read from the saved group
MU = 0.6


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 6))


def gradients(net, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    return [torch.randn(p.shape, generator=gen) for p in net.parameters()]


def run(net, opt, seeds):
    for seed in seeds:
        for p, g in zip(net.parameters(), gradients(net, seed)):
            p.grad = g
        opt.step()


def weights_and_biases(net):
    return [net[0].weight, net[2].weight], [net[0].bias, net[2].bias]


def target(net):
    return Dion3(dion3.param_groups(net, lr=0.02, mu=MU, fraction=0.5))


def adamw_by_route(net, route):
    """A torch AdamW over `net` as a user may have built it: in dion3's grouping (matched by
    position), from named_parameters (matched by name), or over parameters() with the names added
    to its state dict afterwards (the documented one-liner)."""
    weights, biases = weights_and_biases(net)
    if route == "same-groups":
        return torch.optim.AdamW([{"params": weights}, {"params": biases}], lr=1e-3, betas=BETAS)
    if route == "named":
        return torch.optim.AdamW(net.named_parameters(), lr=1e-3, betas=BETAS)
    return torch.optim.AdamW(net.parameters(), lr=1e-3, betas=BETAS)


def set_by_hand(reference, adamw_state_of):
    """The documented conversion, written out: momentum = exp_avg / (1 − β₁ᵗ) / (1 − μ), variance 0;
    AdamW groups take exp_avg, exp_avg_sq and step as saved."""
    for group in reference.param_groups:
        for p in group["params"]:
            saved = adamw_state_of(p)
            if group["algorithm"] == "dion3":
                t = float(saved["step"])
                momentum = saved["exp_avg"].double() / (1 - BETAS[0] ** t) / (1 - group["mu"])
                reference.state[p]["momentum"].copy_(momentum.float())
                assert torch.count_nonzero(reference.state[p]["variance"]) == 0
            else:
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    reference.state[p][key].copy_(saved[key])


def state_set_by_hand(net, twin, dion, adamw):
    """A Dion3 on `twin` (a copy of `net`) whose state is set from `adamw`'s by the documented
    formula; `dion`'s converted state must equal it entry for entry. Returns it."""
    reference = target(twin)
    by_twin = dict(zip(twin.parameters(), net.parameters()))
    set_by_hand(reference, lambda q: adamw.state[by_twin[q]])
    for p, q in zip(net.parameters(), twin.parameters()):
        for key, value in reference.state[q].items():
            assert torch.equal(dion.state[p][key], value), key
    return reference


@pytest.mark.parametrize("route", ["same-groups", "named", "unnamed-with-names-added"])
def test_an_adamw_trained_state_converts_and_steps_as_the_documented_state(route):
    net = model()
    adamw = adamw_by_route(net, route)
    run(net, adamw, range(3))
    saved = adamw.state_dict()
    if route == "unnamed-with-names-added":
        saved["param_groups"][0]["param_names"] = [name for name, _ in net.named_parameters()]
    kept = copy.deepcopy(saved)
    twin = copy.deepcopy(net)

    with pytest.raises(ValueError, match="as torch.optim.AdamW saves"):
        target(net).load_state_dict(saved)
    dion = target(net)
    dion.load_state_dict(convert_state_dict(saved, dion))
    assert saved["param_groups"] == kept["param_groups"]
    assert all(torch.equal(v, kept["state"][pid][k]) for pid, e in saved["state"].items() for k, v in e.items())
    assert [(g["algorithm"], g["lr"]) for g in dion.param_groups] == [("dion3", 0.02), ("adamw", 0.02)]

    reference = state_set_by_hand(net, twin, dion, adamw)
    weights, _ = weights_and_biases(net)
    for w in weights:  # the scaling happened: neither zero nor AdamW's raw exp_avg
        assert torch.count_nonzero(dion.state[w]["momentum"]) > 0
        assert not torch.allclose(dion.state[w]["momentum"], adamw.state[w]["exp_avg"])
    before = [p.detach().clone() for p in net.parameters()]
    run(net, dion, range(3, 5))
    run(twin, reference, range(3, 5))
    for p, q, old in zip(net.parameters(), twin.parameters(), before):
        assert torch.equal(p, q) and not torch.equal(p, old)


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
def test_an_adamw_state_converts_through_torch_distributed_checkpoint(flat):
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    net = model()
    adamw = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=BETAS)
    run(net, adamw, range(3))
    dion = target(net)
    converted = convert_state_dict(get_optimizer_state_dict(net, adamw, options=options),
                                   get_optimizer_state_dict(net, dion, options=options))
    set_optimizer_state_dict(net, dion, converted, options=options)
    twin = copy.deepcopy(net)
    reference = state_set_by_hand(net, twin, dion, adamw)


def test_sgd_momentum_without_dampening_is_muon_momentum_of_the_same_mu():
    net = model()
    weights, _ = weights_and_biases(net)
    sgd = torch.optim.SGD(weights, lr=0.1, momentum=0.9)
    run_weights(net, sgd, weights)
    muon = Muon(weights, mu=0.9)
    muon.load_state_dict(convert_state_dict(sgd.state_dict(), muon))
    for w in weights:  # M ← 0.9·M + G in both: the same buffer
        assert torch.equal(muon.state[w]["momentum"], sgd.state[w]["momentum_buffer"])


def test_sgd_with_dampening_converts_by_the_documented_factor():
    net = model()
    weights, _ = weights_and_biases(net)
    sgd = torch.optim.SGD(weights, lr=0.1, momentum=0.8, dampening=0.1)
    run_weights(net, sgd, weights)
    dion = Dion3(weights, mu=0.5)
    dion.load_state_dict(convert_state_dict(sgd.state_dict(), dion))
    for w in weights:
        expected = sgd.state[w]["momentum_buffer"].double() * (1 - 0.8) / (1 - 0.1) / (1 - 0.5)
        assert torch.equal(dion.state[w]["momentum"], expected.float())
        assert torch.count_nonzero(dion.state[w]["variance"]) == 0


def run_weights(net, opt, weights):
    for seed in range(3):
        for w, g in zip(weights, gradients(net, seed)[::2]):
            w.grad = g
        opt.step()


@pytest.mark.parametrize("make, name", [
    (lambda ps: torch.optim.RMSprop(ps, lr=0.01), "square_avg, as torch.optim.RMSprop saves"),
    (lambda ps: torch.optim.Adagrad(ps, lr=0.01), "sum, as torch.optim.Adagrad saves"),
    (lambda ps: torch.optim.Adam(ps, lr=0.01), "exp_avg/exp_avg_sq, as torch.optim.Adam saves"),
], ids=["rmsprop", "adagrad", "adam"])
def test_other_torch_optimizers_are_named_and_what_does_not_map_starts_at_zero(make, name):
    net = model()
    weights, biases = weights_and_biases(net)
    other = make([{"params": weights}, {"params": biases}])
    run(net, other, range(2))
    saved = other.state_dict()
    dion = target(net)
    before = copy.deepcopy(dion.state_dict())
    with pytest.raises(ValueError) as caught:
        dion.load_state_dict(saved)
    message = str(caught.value)
    assert f"for parameter '0.weight' of group 0 it holds {name}" in message
    assert "dion3.convert_state_dict(state_dict, optimizer)" in message
    assert dion.state_dict()["param_groups"] == before["param_groups"]  # refused before anything changed
    dion.load_state_dict(convert_state_dict(saved, dion))
    adam = "exp_avg" in name
    for w in weights:
        assert (torch.count_nonzero(dion.state[w]["momentum"]) > 0) == adam
    for b in biases:  # Adam's moments go to the AdamW group as saved; RMSprop's and Adagrad's nowhere
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if adam:
                assert torch.equal(dion.state[b][key], other.state[b][key]), key
            else:
                assert torch.count_nonzero(dion.state[b][key]) == 0, key


def test_an_optimizer_that_never_stepped_converts_to_fresh_state():
    net = model()
    adamw = torch.optim.AdamW(net.named_parameters())
    dion = target(net)
    with pytest.raises(ValueError, match="its group 0 holds no state, and settings of torch.optim"):
        dion.load_state_dict(adamw.state_dict())
    dion.load_state_dict(convert_state_dict(adamw.state_dict(), dion))
    assert all(torch.count_nonzero(v) == 0 for entry in dion.state.values() for v in entry.values())


def test_an_unnamed_state_dict_in_another_grouping_says_how_to_name_it():
    net = model()
    adamw = torch.optim.AdamW(net.parameters())
    run(net, adamw, range(1))
    with pytest.raises(ValueError, match=r"groups hold \[4\] parameters but the target's hold \[2, 2\].*takes them in "
                                         "one line"):
        convert_state_dict(adamw.state_dict(), target(net))


def test_the_snippet_of_the_training_guide_runs_and_converts_as_it_says():
    from pathlib import Path
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    section = text[text.index("## Switching from AdamW or another torch optimizer"):]
    section = section[:section.index("\n## ", 1)]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(snippet, namespace)
    optimizer, adamw = namespace["optimizer"], namespace["adamw"]
    matrices = [p for g in optimizer.param_groups if g["algorithm"] == "dion3" for p in g["params"]]
    assert len(matrices) == 2
    for p in matrices:  # default betas (0.9, 0.999), three steps, mu=0.95 as the snippet builds it
        expected = adamw.state[p]["exp_avg"].double() / (1 - 0.9 ** 3) / (1 - 0.95)
        assert torch.equal(optimizer.state[p]["momentum"], expected.float())
