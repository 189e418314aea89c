"""State dicts across algorithms and unknown group keys.

`load_state_dict` refuses a group saved by another algorithm (torch.optim would take the saved
group, algorithm included); `convert_state_dict` switches on purpose: the momentum carries over,
entries the source did not keep start at zero, the settings are the target's. Checked on plain
state dicts, on torch.distributed.checkpoint's forms (by FQN, nested and flat) in one process, and
through DCP under FSDP2 on 2 gloo ranks against one process.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict,
)

import gloo
from test_distributed_resume import set_grads
from dion3 import Dion3, Muon, NorMuon, convert_state_dict

TRAINING = Path(__file__).resolve().parents[1] / "docs" / "training.md"


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 6)
        self.out = torch.nn.Linear(6, 4)

    def groups(self, scalar="adamw", scalar_lr=0.003):
        return [{"params": [self.inp.weight, self.out.weight]},
                {"params": [self.inp.bias, self.out.bias], "algorithm": scalar, "lr": scalar_lr}]


def grads_for(net, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) for p in net.parameters()]


def step(net, opt, seed):
    for p, g in zip(net.parameters(), grads_for(net, seed)):
        p.grad = g
    opt.step()


def stepped(factory, net=None, steps=2, **options):
    net = net or Net()
    opt = factory(net.groups(**options.pop("groups", {})), **options)
    for seed in range(steps):
        step(net, opt, seed)
    return net, opt


def snapshot(opt):
    return copy.deepcopy(opt.state_dict())


def assert_same(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid, entry in a["state"].items():
        assert entry.keys() == b["state"][pid].keys()
        for key, value in entry.items():
            assert torch.equal(value, b["state"][pid][key]), (pid, key)


# ------------------------------------------------------------------ refused without conversion
REFUSED = {
    "muon-to-dion3": (Muon, {}, Dion3, {}, 0, "muon", "dion3"),
    "dion3-to-normuon": (Dion3, {}, NorMuon, {}, 0, "dion3", "normuon"),
    "normuon-to-muon": (NorMuon, {}, Muon, {}, 0, "normuon", "muon"),
    "adamw-to-lion": (Dion3, {}, Dion3, {"groups": {"scalar": "lion"}}, 1, "adamw", "lion"),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED)
def test_a_state_dict_of_another_algorithm_is_refused_and_changes_nothing(case):
    source, source_options, target, target_options, group, saved, built = case
    net, opt = stepped(source, **source_options)
    saved_state = opt.state_dict()
    loading = target(net.groups(**target_options.pop("groups", {})), **target_options)
    step(net, loading, 7)
    before = snapshot(loading)
    with pytest.raises(ValueError) as caught:
        loading.load_state_dict(saved_state)
    message = str(caught.value)
    assert f"parameter group {group} of the state dict was saved by algorithm {saved!r}" in message
    assert f"but this optimizer runs {built!r} there" in message
    assert "dion3.convert_state_dict(state_dict, optimizer)" in message
    assert_same(loading.state_dict(), before)  # refused before torch replaced anything


def test_dcp_set_optimizer_state_dict_is_refused_too():
    net, muon = stepped(Muon)
    saved = get_optimizer_state_dict(net, muon)
    target = Dion3(net.groups())
    with pytest.raises(ValueError, match="saved by algorithm 'muon', but this optimizer runs 'dion3' there"):
        set_optimizer_state_dict(net, target, saved)


def test_groups_saved_without_an_algorithm_or_under_an_alias_still_load():
    net, opt = stepped(Dion3)
    legacy = opt.state_dict()
    for group in legacy["param_groups"]:
        del group["algorithm"]  # as saved before groups named their algorithm
    resumed = Dion3(net.groups())
    resumed.load_state_dict(legacy)
    assert [g["algorithm"] for g in resumed.param_groups] == ["dion3", "adamw"]
    aliased = opt.state_dict()
    aliased["param_groups"][0]["algorithm"] = "nordion2"
    again = Dion3(net.groups())
    again.load_state_dict(aliased)
    assert again.param_groups[0]["algorithm"] == "dion3"


def test_same_algorithm_round_trip_is_exact():
    net, opt = stepped(Dion3, lr=0.02, fraction=0.5)
    saved = snapshot(opt)
    resumed = Dion3(net.groups(), lr=0.1, fraction=0.25)  # settings the checkpoint replaces, as in torch.optim
    resumed.load_state_dict(saved)
    assert_same(resumed.state_dict(), saved)
    twin = copy.deepcopy(net)
    twin_opt = Dion3(twin.groups())
    twin_opt.load_state_dict(saved)
    step(net, opt, 5)
    step(twin, twin_opt, 5)
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ the documented switch
def test_dion3_starts_from_a_muon_checkpoint_with_its_momentum_and_own_settings():
    net, muon = stepped(Muon, mu=0.9, lr=0.05, groups={"scalar_lr": 0.003})
    g0, g1 = grads_for(net, 0), grads_for(net, 1)
    saved = muon.state_dict()
    untouched = snapshot(muon)
    dion = Dion3(net.groups(scalar_lr=0.007), lr=0.02, fraction=0.5, mu=0.8)
    dion.load_state_dict(convert_state_dict(saved, dion))
    assert_same(saved, untouched)  # the saved state dict is not modified

    matrix, scalar = dion.param_groups
    assert (matrix["algorithm"], matrix["lr"], matrix["fraction"], matrix["mu"]) == ("dion3", 0.02, 0.5, 0.8)
    assert (scalar["algorithm"], scalar["lr"]) == ("adamw", 0.007)
    for i, w in enumerate(matrix["params"]):
        # Muon's momentum after two steps from zero: M = 0.9·G₀ + G₁
        torch.testing.assert_close(dion.state[w]["momentum"], 0.9 * g0[2 * i] + g1[2 * i], rtol=1e-6, atol=1e-6)
        assert dion.state[w]["variance"].shape == (w.shape[0], 1)
        assert torch.count_nonzero(dion.state[w]["variance"]) == 0
    for i, b in enumerate(scalar["params"]):  # AdamW → AdamW: its whole state, by hand
        g0b, g1b = g0[2 * i + 1], g1[2 * i + 1]
        torch.testing.assert_close(dion.state[b]["exp_avg"], 0.1 * (0.9 * g0b + g1b), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(dion.state[b]["exp_avg_sq"], 0.05 * (0.95 * g0b**2 + g1b**2), rtol=1e-6, atol=1e-7)
        assert float(dion.state[b]["step"]) == 2.0

    # it steps as a Dion3 whose momentum was set to that by hand
    twin = copy.deepcopy(net)
    reference = Dion3(twin.groups(scalar_lr=0.007), lr=0.02, fraction=0.5, mu=0.8)
    for w, v in zip(twin.parameters(), net.parameters()):
        for key, value in dion.state[v].items():
            reference.state[w][key].copy_(value)
    before = [p.detach().clone() for p in net.parameters()]
    step(net, dion, 2)
    step(twin, reference, 2)
    for a, b, old in zip(net.parameters(), twin.parameters(), before):
        assert torch.equal(a, b) and not torch.equal(a, old)
        for key in dion.state[a]:
            assert torch.equal(dion.state[a][key], reference.state[b][key]), key


def test_normuon_to_dion3_keeps_the_variance_and_dion3_to_muon_drops_it():
    net, normuon = stepped(NorMuon)
    dion = Dion3(net.groups())
    dion.load_state_dict(convert_state_dict(normuon.state_dict(), dion))
    for w in dion.param_groups[0]["params"]:
        assert torch.equal(dion.state[w]["variance"], normuon.state[w]["variance"])
        assert torch.count_nonzero(dion.state[w]["variance"]) > 0
    muon = Muon(net.groups())
    converted = convert_state_dict(dion.state_dict(), muon)
    assert {k for entry in list(converted["state"].values())[:2] for k in entry} == {"momentum"}
    muon.load_state_dict(converted)
    for w in muon.param_groups[0]["params"]:
        assert set(muon.state[w]) == {"momentum"} and torch.equal(muon.state[w]["momentum"], dion.state[w]["momentum"])


def test_adamw_to_lion_carries_exp_avg_and_lion_to_adamw_starts_the_second_moment_at_zero():
    net, adamw = stepped(Dion3)
    lion = Dion3(net.groups(scalar="lion"))
    lion.load_state_dict(convert_state_dict(adamw.state_dict(), lion))
    back = Dion3(net.groups())
    back.load_state_dict(convert_state_dict(lion.state_dict(), back))
    for b in lion.param_groups[1]["params"]:
        assert set(lion.state[b]) == {"exp_avg"} and torch.equal(lion.state[b]["exp_avg"], adamw.state[b]["exp_avg"])
        assert torch.equal(back.state[b]["exp_avg"], adamw.state[b]["exp_avg"])
        assert torch.count_nonzero(back.state[b]["exp_avg_sq"]) == 0 and float(back.state[b]["step"]) == 0.0


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
def test_the_switch_through_torch_distributed_checkpoint(flat):
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    net, muon = stepped(Muon)
    saved = get_optimizer_state_dict(net, muon, options=options)
    dion = Dion3(net.groups(scalar_lr=0.007), lr=0.02, fraction=0.5)
    converted = convert_state_dict(saved, get_optimizer_state_dict(net, dion, options=options))
    set_optimizer_state_dict(net, dion, converted, options=options)
    assert [(g["algorithm"], g["lr"]) for g in dion.param_groups] == [("dion3", 0.02), ("adamw", 0.007)]
    assert dion.param_groups[0]["fraction"] == 0.5
    for w in dion.param_groups[0]["params"]:
        assert torch.equal(dion.state[w]["momentum"], muon.state[w]["momentum"])
        assert torch.count_nonzero(dion.state[w]["variance"]) == 0
    for b in dion.param_groups[1]["params"]:
        for key, value in muon.state[b].items():
            assert torch.equal(dion.state[b][key], value), key
    step(net, dion, 3)
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_conversion_errors_name_what_does_not_match():
    net, muon = stepped(Muon)
    saved = muon.state_dict()
    other = torch.nn.Linear(8, 6)
    with pytest.raises(ValueError, match=r"groups hold \[2, 2\] parameters but the target's hold \[1\], and without "
                                         "parameter names"):
        convert_state_dict(saved, Dion3([other.weight]))
    broken = muon.state_dict()
    del broken["state"][0]["momentum"]
    with pytest.raises(ValueError, match=r"has no 'momentum' for parameter 0 of group 0, which 'muon' keeps"):
        convert_state_dict(broken, Dion3(net.groups()))
    flat = get_optimizer_state_dict(net, muon, options=StateDictOptions(flatten_optimizer_state_dict=True))
    with pytest.raises(ValueError, match="pass the target's state dict in the saved one's form"):
        convert_state_dict(flat, Dion3(net.groups()))


def test_a_run_regrouped_by_cost_resumes_each_parameter_from_its_own_state():
    """Saved with one matrix group (fraction ¼ on every matrix), resumed with one group per shape
    (fraction_allocation="cost"): convert_state_dict matches the parameters by name. Reference: the
    same new optimizer with every state entry copied in by hand, parameter by parameter."""
    from dion3 import param_groups
    from dion3.tools.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=8, n_layer=2, n_head=2, d_model=32, vocab_size=64))
    uniform = Dion3(param_groups(model, lm_head="lm_head", lr=0.03, mu=0.6, fraction=0.25))
    tokens = torch.randint(0, 64, (4, 8))
    for _ in range(2):
        model(tokens, tokens).backward()
        uniform.step()
        uniform.zero_grad()
    saved = uniform.state_dict()

    def by_cost(net):
        return Dion3(param_groups(net, lm_head="lm_head", lr=0.03, mu=0.6, fraction=0.25, fraction_allocation="cost"))

    twin = copy.deepcopy(model)
    regrouped, reference = by_cost(model), by_cost(twin)
    assert len(regrouped.param_groups) != len(uniform.param_groups)  # the groups do differ
    with pytest.raises(ValueError, match="state dict has 4 parameter groups but this optimizer has"):
        regrouped.load_state_dict(saved)
    regrouped.load_state_dict(convert_state_dict(saved, regrouped))
    by_name = {name: p for g in uniform.param_groups for name, p in zip(g["param_names"], g["params"])}
    for group, twin_group in zip(regrouped.param_groups, reference.param_groups):
        for name, p, q in zip(group["param_names"], group["params"], twin_group["params"]):
            for key, value in uniform.state[by_name[name]].items():
                assert torch.equal(regrouped.state[p][key], value), (name, key)
                reference.state[q][key].copy_(value)
    for net, opt in ((model, regrouped), (twin, reference)):
        net(tokens, tokens).backward()
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


class _AttentionAndMLP(torch.nn.Module):
    """Shapes on which fractions by cost and with the most rows differ (q/v/o 16 × 16, k 8 × 16, an
    MLP 24 × 16 and 16 × 24: 0.8125, 0.75, 1/6, 1/8 against 0.3125, 1, 0.21, 1 at ½)."""

    def __init__(self):
        super().__init__()
        linear = lambda a, b: torch.nn.Linear(a, b, bias=False)  # noqa: E731
        self.q, self.k, self.v, self.o, self.up, self.down = (linear(16, 16), linear(16, 8), linear(16, 16),
                                                              linear(16, 16), linear(16, 24), linear(24, 16))


def test_a_checkpoint_by_cost_loaded_with_the_most_rows_is_said_and_stays_one_rule():
    """Resumed with fraction_allocation="most_rows" from a checkpoint by cost: torch loads the saved
    fractions, so load_state_dict warns and the groups keep the checkpoint's rule whole (no
    most-rows flag left on fractions by cost); convert_state_dict keeps this optimizer's fractions,
    silently. The same allocation on both sides loads without a word."""
    import warnings

    from dion3 import param_groups
    from dion3.optim.budget_schedule import allocation_rule

    torch.manual_seed(0)
    model = _AttentionAndMLP()

    def build(allocation):
        return Dion3(param_groups(model, lm_head=False, fraction=0.5, fraction_allocation=allocation))

    by_cost = build("cost")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    by_cost.step()
    saved = by_cost.state_dict()
    cost_fractions = [g["fraction"] for g in by_cost.param_groups]
    most_rows = build("most_rows")
    wanted = [g["fraction"] for g in most_rows.param_groups]
    assert wanted != cost_fractions
    with pytest.warns(UserWarning, match=r"parameter groups 0, 1, 2, 3 of the state dict were allocated by another "
                                         r"rule than this optimizer's \(group 0: fractions by cost, here the most "
                                         r"rows\).*dion3.convert_state_dict"):
        most_rows.load_state_dict(saved)
    assert [g["fraction"] for g in most_rows.param_groups] == cost_fractions
    assert all(allocation_rule(g)[1] is False and "fraction_most_rows" not in g for g in most_rows.param_groups)
    converted = build("most_rows")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted.load_state_dict(convert_state_dict(saved, converted))
        build("cost").load_state_dict(saved)
    assert [g["fraction"] for g in converted.param_groups] == wanted
    assert all(allocation_rule(g)[1] is True for g in converted.param_groups)


def test_regrouping_needs_every_parameter_by_name():
    net = Net()
    named = Dion3([{"params": [("inp.weight", net.inp.weight), ("out.weight", net.out.weight)]},
                   {"params": [("inp.bias", net.inp.bias), ("out.bias", net.out.bias)], "algorithm": "adamw"}])
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    named.step()
    saved = named.state_dict()
    other = Net()
    regrouped = Dion3([{"params": [("inp.weight", other.inp.weight)]}, {"params": [("out.weight", other.out.weight)]},
                       {"params": [("inp.bias", other.inp.bias), ("head.bias", other.out.bias)], "algorithm": "adamw"}])
    with pytest.raises(ValueError, match=r"has no parameter 'head.bias' \(of 1 missing\)"):
        convert_state_dict(saved, regrouped)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_snippets_of_the_training_guide_run(tmp_path, monkeypatch):
    text = TRAINING.read_text()
    section = text[text.index("## Switching algorithms"):]
    section = section[:section.index("\n## ", 1)]
    plain, with_dcp = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    monkeypatch.chdir(tmp_path)  # the DCP snippet writes its checkpoint into the working directory
    namespace: dict = {}
    exec(plain, namespace)
    optimizer, muon = namespace["optimizer"], namespace["muon"]
    matrices = [p for g in optimizer.param_groups if g["algorithm"] == "dion3" for p in g["params"]]
    assert matrices and all(torch.equal(optimizer.state[p]["momentum"], muon.state[p]["momentum"]) for p in matrices)
    for p in matrices:
        optimizer.state[p]["momentum"].zero_()
    exec(with_dcp, namespace)
    assert all(torch.equal(optimizer.state[p]["momentum"], muon.state[p]["momentum"]) for p in matrices)
    assert all(torch.count_nonzero(optimizer.state[p]["variance"]) == 0 for p in matrices)


# ------------------------------------------------------------------ the switch under FSDP2 (gloo)
SHARDED_SHAPES = [(16, 24), (3, 8), (5, 7)]  # a zero-row shard and an uneven one at W = 2
SHARDED_BIASES = [6, 3]


class ShardedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHARDED_SHAPES)
        self.biases = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SHARDED_BIASES)

    def groups(self):
        return [{"params": list(self.weights)}, {"params": list(self.biases), "algorithm": "adamw", "lr": 0.01}]


def sharded_step(net, opt, seed, world, rank):
    gen = torch.Generator().manual_seed(900 + seed)
    grads = [torch.randn(s, generator=gen) for s in SHARDED_SHAPES] + [torch.randn(n, generator=gen) for n in SHARDED_BIASES]
    set_grads([*net.weights, *net.biases], grads, world, rank)  # each rank's rows of every gradient
    opt.step()


def muon_then_dion3(mesh, world, rank, checkpoint=None):
    """Two Muon steps, the switch to Dion3 (through DCP when `checkpoint` names a directory), one
    Dion3 step; returns the model and the Dion3 optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    def model():
        net = ShardedNet()
        if mesh is not None:
            fully_shard(net, mesh=mesh)
        return net

    settings = dict(distributed_mesh=mesh, orthogonalizer="newton_schulz")
    net = model()
    muon = Muon(net.groups(), lr=0.02, **settings)
    for seed in range(2):
        sharded_step(net, muon, seed, world, rank)
    if checkpoint is None:
        dion = Dion3(net.groups(), lr=0.01, fraction=0.5, selection_scope="global", **settings)
        dion.load_state_dict(convert_state_dict(muon.state_dict(), dion))
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        dcp.save({"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, muon)}, checkpoint_id=checkpoint)
        net = model()  # fresh weights and state: everything comes from the checkpoint
        saved = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, Muon(net.groups(), **settings))}
        dcp.load(saved, checkpoint_id=checkpoint)
        set_model_state_dict(net, saved["model"])
        dion = Dion3(net.groups(), lr=0.01, fraction=0.5, selection_scope="global", **settings)
        set_optimizer_state_dict(net, dion, convert_state_dict(saved["optim"], get_optimizer_state_dict(net, dion)))
    sharded_step(net, dion, 2, world, rank)
    return net, dion


def switch_worker(rank, world, store, checkpoint, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach()

    gloo.start(rank, world, store)
    try:
        net, dion = muon_then_dion3(init_device_mesh("cpu", (world,)), world, rank, checkpoint)
        reference, reference_opt = muon_then_dion3(None, 1, 0)
        worst = 0.0
        for p, q in zip([*net.weights, *net.biases], [*reference.weights, *reference.biases]):
            pairs = [(full(p), q.detach())] + [(full(dion.state[p][k]).reshape(v.shape), v)
                                               for k, v in reference_opt.state[q].items()]
            for got, want in pairs:
                worst = max(worst, float((got.double() - want.double()).abs().max()
                                         / want.double().abs().max().clamp_min(1e-12)))
        algorithms = [g["algorithm"] for g in dion.param_groups]
        if rank == 0:
            Path(out).write_text(json.dumps({"worst": worst, "algorithms": algorithms}))
    finally:
        gloo.stop()


def test_the_switch_through_dcp_under_fsdp2_matches_one_process(tmp_path):
    out = tmp_path / "result.json"
    gloo.spawn(switch_worker, (2, str(tmp_path / "store"), str(tmp_path / "checkpoint"), str(out)), 2,
               str(tmp_path / "store"))
    result = json.loads(out.read_text())
    assert result["algorithms"] == ["dion3", "adamw"]
    assert result["worst"] <= 1e-5, result
