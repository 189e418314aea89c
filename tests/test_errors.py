"""Every bad input of docs/errors.md gets its documented error type and message.

The table below is the source of truth for the tests; a final test checks that each row id
also appears in the doc, so the two cannot drift apart.
"""
from __future__ import annotations

import copy
import pathlib
import re

import pytest
import torch

from dion3 import Dion3, FractionScheduler, Muon, NorMuon, PeriodicFull, orthogonalize, param_groups

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def param(*shape, dtype=torch.float32):
    return torch.nn.Parameter(torch.randn(*shape).to(dtype))


def two_groups(matrix_shapes=((4, 6), (3, 5))):
    """A Dion3 optimizer with one matrix group and one AdamW group for a bias."""
    matrices = [param(*s) for s in matrix_shapes]
    return Dion3([{"params": matrices}, {"params": [param(5)], "algorithm": "adamw"}])


def stepped_state_dict():
    opt = two_groups()
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    opt.step()
    return opt.state_dict()


def step_with_grad(value, check_finite=True):
    w = param(4, 4)
    opt = Dion3([{"params": [("w", w)]}], check_finite=check_finite)
    w.grad = torch.full_like(w, value)
    opt.step()


def load_into(shapes, edit=None):
    state_dict = stepped_state_dict()
    if edit is not None:
        edit(state_dict)
    opt = Dion3([param(*s) for s in shapes]) if len(shapes) == 1 else two_groups(shapes)
    opt.load_state_dict(state_dict)


def drop_variance(state_dict):
    del state_dict["state"][0]["variance"]


def fraction_set_between_steps():
    w = param(4, 4)
    opt = Dion3([w])
    opt.param_groups[0]["fraction"] = 0.0  # as a hand-written schedule might
    w.grad = torch.randn_like(w)
    opt.step()


def schedule_by_cost_beside(extra):
    """A FractionScheduler over groups by cost (budget 0.5: a 32×64 and a 128×32 matrix, groups 0
    and 1) and the named groups `extra` returns after them."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 128, bias=False))
    groups = param_groups(model, lm_head=False, fraction=0.5, fraction_allocation="cost")
    FractionScheduler(Dion3(groups + extra()), lambda step: 0.5)


def muon_state_into_dion3():
    w = param(4, 4)
    muon = Muon([w])
    w.grad = torch.randn_like(w)
    muon.step()
    Dion3([w]).load_state_dict(muon.state_dict())


def add_unnamed_group_to_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = Dion3(param_groups(model, lm_head=False))  # a matrix group and a bias group, named
    opt.add_param_group({"params": [param(4, 4)]})


def add_named_group_to_unnamed():
    opt = Dion3([param(4, 4)])
    opt.add_param_group({"params": [("extra.weight", param(4, 4))]})


def torch_state_into_dion3(make, steps=1):
    """A torch.optim optimizer's state dict (after `steps` steps) loaded into Dion3 on the same, named matrix."""
    w = param(4, 4)
    other = make([w])
    for _ in range(steps):
        w.grad = torch.randn_like(w)
        other.step()
    Dion3([("w", w)]).load_state_dict(other.state_dict())


def shared_param():
    w = param(4, 4)
    Dion3([{"params": [w]}, {"params": [w], "algorithm": "muon"}])


def repeated_param():
    w = param(4, 4)
    Dion3([("a.weight", w), ("b.weight", param(4, 4)), ("c.weight", w)])


def two_models_in_one_optimizer():
    """Two models' groups in one optimizer: both name their matrix 'blocks.0.fc.weight'."""
    def model():
        return torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([torch.nn.ModuleDict({"fc": torch.nn.Linear(4, 4)})])})
    Dion3(param_groups(model(), lm_head=False) + param_groups(model(), lm_head=False))


def sparse_gradient_in(algorithm):
    def action():
        embedding = torch.nn.Embedding(10, 4, sparse=True)
        opt = Dion3([{"params": [("embed.weight", embedding.weight)], "algorithm": algorithm}])
        embedding(torch.tensor([1, 3])).sum().backward()
        opt.step()
    return action


# (row id, action, error type, message fragment)
CASES = [
    ("one-d-in-matrix-group", lambda: Dion3([param(8)]), ValueError, "is 1-D"),
    ("model-parameters-with-a-bias", lambda: Dion3(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).parameters()),
     ValueError, "parameter 1 (shape (8,)) is 1-D, but algorithm 'dion3' orthogonalizes matrices; put 1-D parameters "
     "(biases, norms) in an 'adamw' or 'lion' group. For a whole model, pass dion3.param_groups(model, lm_head=...)"),
    ("four-d-without-flatten", lambda: Muon([param(2, 3, 4, 5)]), ValueError, "pass flatten=True"),
    ("three-d-undeclared", lambda: Dion3([torch.nn.Conv1d(4, 8, 3).weight]), ValueError,
     "is 3-D: a convolution kernel (out, in, k) or a stack of matrices [E, rows, cols]? Pass flatten=True for a "
     "convolution kernel, trained as one 8×12 matrix, or stacked=True for 8 matrices of 4×3"),
    ("flatten-and-stacked", lambda: Dion3([{"params": [param(3, 4, 5)], "stacked": True}], flatten=True), ValueError,
     "flatten=True (every parameter one matrix) and stacked=True (a 3-D parameter a stack of matrices) contradict "
     "each other"),
    ("flatten-channels-last", lambda: Muon([torch.nn.Parameter(torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last))], flatten=True),
     ValueError, "cannot be flattened to [rows, -1] in place"),
    ("integer-matrix", lambda: Dion3([torch.zeros(4, 4, dtype=torch.int64)]), ValueError, "has dtype torch.int64"),
    ("complex-matrix", lambda: Muon([param(4, 4, dtype=torch.complex64)]), ValueError, "has dtype torch.complex64"),
    ("empty-matrix", lambda: NorMuon([param(0, 4)]), ValueError, "is empty (a dimension is 0)"),
    ("named-parameter-label", lambda: Dion3([{"params": [("layer.bias", param(8))]}]), ValueError, "'layer.bias' is 1-D"),
    ("group-unknown-key", lambda: Dion3([{"params": [param(4, 4)], "fracton": 0.5}]), ValueError,
     "parameter group 0 has an unknown key 'fracton' (did you mean 'fraction'?)"),
    ("group-without-params", lambda: Dion3([{"lr": 0.1}]), ValueError, "parameter group 0 has no 'params' entry"),
    ("group-without-param-names", add_unnamed_group_to_named, ValueError,
     "parameter group 2 has no 'param_names', but the other groups carry them (errors name parameters by them): "
     'add them, as in {"params": [...], "param_names": [...]}'),
    ("group-param-names-among-unnamed", add_named_group_to_unnamed, ValueError,
     "parameter group 1 has 'param_names', but the other groups have none"),
    ("group-param-names-count", lambda: Dion3([{"params": [param(4, 4), param(4, 4)], "param_names": ["a"]}]), ValueError,
     "parameter group 0 has 1 param_names for 2 parameters"),
    ("group-mixes-named-and-bare", lambda: Dion3([("a", param(4, 4)), param(4, 4)]), ValueError,
     "parameter group 0 mixes (name, tensor) pairs and bare tensors"),
    ("parameter-in-two-groups", shared_param, ValueError, "already belongs to parameter group 0"),
    ("parameter-twice-in-a-group", repeated_param, ValueError,
     "parameter 'c.weight' appears twice in parameter group 0 (also 'a.weight')"),
    ("parameter-name-in-two-groups", two_models_in_one_optimizer, ValueError,
     "parameter group 2 names a parameter 'blocks.0.fc.weight', and so does parameter group 0 (another parameter); "
     "parameter names must be unique (errors and state dicts tell parameters apart by them), e.g. prefix each "
     "model's names ('a.blocks.0.fc.weight' and 'b.blocks.0.fc.weight')"),
    ("parameter-name-twice-in-a-group", lambda: Muon([{"params": [param(4, 4), param(4, 4)], "param_names": ["w", "w"]}]),
     ValueError, "parameter group 0 gives the name 'w' to two parameters (positions 0 and 1); parameter names must be unique"),
    ("fraction-zero", lambda: Dion3([param(4, 4)], fraction=0.0), ValueError, "fraction must lie in (0.0, 1.0]"),
    ("fraction-above-one", lambda: Dion3([param(4, 4)], fraction=1.5), ValueError, "fraction must lie in (0.0, 1.0]"),
    ("fraction-schedule-out-of-range", lambda: FractionScheduler(Dion3([param(4, 4)]), lambda step: 1.5), ValueError,
     "parameter group 0 (fraction schedule at step 0): fraction must lie in (0.0, 1.0]"),
    ("fraction-schedule-over-different-fractions",
     lambda: FractionScheduler(Dion3([{"params": [param(4, 4)], "fraction": 0.5}, {"params": [param(8, 4)], "fraction": 0.25}]),
                               lambda step: 0.5),
     ValueError, "the Dion3 groups hold different fractions (group 0: 0.5, group 1: 0.25)"),
    ("fraction-schedule-by-cost-beside-a-fraction",
     lambda: schedule_by_cost_beside(lambda: [{"params": [param(8, 4)], "param_names": ["extra.weight"], "fraction": 0.25}]),
     ValueError, "FractionScheduler: groups 0, 1 hold fractions by cost (param_groups(..., fraction_allocation='cost')) "
     "and group 2 a fraction of its own"),
    ("fraction-schedule-by-cost-two-budgets",
     lambda: schedule_by_cost_beside(lambda: param_groups(torch.nn.Linear(16, 8, bias=False), lm_head=False, fraction=0.25,
                                                          fraction_allocation="cost")),
     ValueError, "FractionScheduler: the groups by cost were allocated apart (groups 0, 1: budget 0.5; group 2: budget "
     "0.25), and a schedule sets one budget; build one FractionScheduler per allocation"),
    ("fraction-allocation-unknown", lambda: param_groups(torch.nn.Linear(4, 4), lm_head="weight", fraction_allocation="cheap"),
     ValueError, "fraction_allocation must be one of ('uniform', 'cost', 'most_rows')"),
    ("fraction-allocation-cost-without-fraction",
     lambda: param_groups(torch.nn.Linear(4, 4), lm_head="weight", fraction_allocation="cost"),
     ValueError, "fraction_allocation='cost' needs fraction="),
    ("fraction-allocation-cost-fraction-zero",
     lambda: param_groups(torch.nn.Linear(4, 4), lm_head=False, fraction=0, fraction_allocation="cost"),
     ValueError, "param_groups: fraction must lie in (0, 1], got 0"),
    ("fraction-allocation-cost-fraction-above-one",
     lambda: param_groups(torch.nn.Linear(4, 4), lm_head=False, fraction=1.5, fraction_allocation="cost"),
     ValueError, "param_groups: fraction must lie in (0, 1], got 1.5"),
    ("fraction-weights-without-cost",
     lambda: param_groups(torch.nn.Linear(4, 4), lm_head=False, fraction=0.5, fraction_weights={"weight": 2.0}),
     ValueError, "fraction_weights weigh the rows of fraction_allocation='cost'"),
    ("fraction-weights-unknown-name",
     lambda: param_groups(torch.nn.Linear(4, 4), lm_head=False, fraction=0.5, fraction_allocation="cost",
                          fraction_weights={"mlp": 2.0}),
     ValueError, "param_groups: no matrix of the group has ['mlp'] in its name"),
    ("fraction-weights-split-shape",
     lambda: param_groups(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), lm_head=False, fraction=0.5,
                          fraction_allocation="cost", fraction_weights={"0.": 2.0}),
     ValueError, "share the shape 4x4, which gets one fraction: give them one weight"),
    ("fraction-set-between-steps", fraction_set_between_steps, ValueError, "parameter group 0: fraction must lie in (0.0, 1.0]"),
    ("unknown-algorithm", lambda: Dion3([{"params": [param(4, 4)], "algorithm": "sgd"}]), ValueError, "unknown algorithm 'sgd'"),
    ("unknown-coefficients", lambda: Muon([param(4, 4)], ns_coefficients="fast"), ValueError, "unknown ns_coefficients 'fast'"),
    ("coefficients-not-triples", lambda: Muon([param(4, 4)], ns_coefficients=[(3.0, -4.0)]), ValueError, "(a, b, c) triples"),
    ("coefficients-not-finite", lambda: Muon([param(4, 4)], ns_coefficients=[(float("nan"), 1.0, 1.0)]), ValueError, "must be finite"),
    ("negative-lr", lambda: Muon([param(4, 4)], lr=-0.1), ValueError, "lr must be a finite number ≥ 0"),
    ("nan-lr", lambda: Dion3([param(4, 4)], lr=float("nan")), ValueError, "lr must be a finite number ≥ 0"),
    ("bool-lr", lambda: Dion3([param(4, 4)], lr=True), TypeError, "lr must be a number, got bool True"),
    ("string-fraction", lambda: Dion3([param(4, 4)], fraction="0.25"), TypeError, "fraction must be a number, got str '0.25'"),
    ("none-weight-decay", lambda: Muon([param(4, 4)], weight_decay=None), TypeError, "weight_decay must be a number, got NoneType"),
    ("unknown-momentum-dtype", lambda: Dion3([param(4, 4)], momentum_dtype="float16"), ValueError,
     "momentum_dtype must be None (the parameter's dtype), 'float32' or 'bfloat16'"),
    ("lm-head-not-named", lambda: param_groups(torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 20))),
     ValueError, "lm_head=None means the model has no LM head, but '1' projects 4 features onto the 20-token vocabulary"),
    ("lr-tensor-with-many-values", lambda: Dion3([param(4, 4)], lr=torch.tensor([0.1, 0.2])), ValueError, "lr tensor must hold one value"),
    ("negative-momentum", lambda: Muon([param(4, 4)], mu=-0.5), ValueError, "mu must lie in [0.0, 1.0)"),
    ("momentum-one", lambda: Dion3([param(4, 4)], mu=1.0), ValueError, "mu must lie in [0.0, 1.0)"),
    ("muon-beta2-one", lambda: NorMuon([param(4, 4)], muon_beta2=1.0), ValueError, "muon_beta2 must lie in [0.0, 1.0)"),
    ("negative-weight-decay", lambda: Dion3([param(4, 4)], weight_decay=-1.0), ValueError, "weight_decay must lie in [0.0, inf)"),
    ("infinite-weight-decay", lambda: Muon([param(4, 4)], weight_decay=float("inf")), ValueError,
     "weight_decay must lie in [0.0, inf), got inf"),
    ("zero-epsilon", lambda: Dion3([param(4, 4)], epsilon=0.0), ValueError, "epsilon must lie in (0.0, inf)"),
    ("infinite-epsilon", lambda: Dion3([{"params": [param(4)], "algorithm": "adamw", "epsilon": float("inf")}]), ValueError,
     "epsilon must lie in (0.0, inf), got inf"),
    ("string-nesterov", lambda: Muon([param(4, 4)], nesterov="yes"), TypeError, "nesterov must be True or False, got str 'yes'"),
    ("string-flatten", lambda: Muon([param(8, 4, 3, 3)], flatten="no"), TypeError, "flatten must be True or False, got str 'no'"),
    ("string-stacked", lambda: Muon([param(3, 4, 5)], stacked="no"), TypeError, "stacked must be True or False, got str 'no'"),
    ("string-check-finite", lambda: Dion3([param(4, 4)], check_finite="no"), TypeError,
     "check_finite must be True or False, got str 'no'"),
    ("betas-not-a-pair", lambda: Dion3([param(4, 4)], betas=(0.9,)), ValueError, "betas must be a pair"),
    ("betas-none", lambda: Dion3([param(4, 4)], betas=None), ValueError, "betas must be a pair"),
    ("adamw-beta2-one", lambda: Dion3([{"params": [param(4)], "algorithm": "adamw", "betas": (0.9, 1.0)}]), ValueError, "betas[1] must lie in [0.0, 1.0)"),
    ("unknown-adjust-lr", lambda: Dion3([param(4, 4)], adjust_lr="fan_in"), ValueError, "unknown adjust_lr 'fan_in'"),
    ("unknown-orthogonalizer", lambda: Dion3([param(4, 4)], orthogonalizer="svd"), ValueError, "unknown orthogonalizer 'svd'"),
    ("unknown-selection-scope", lambda: Dion3([param(4, 4)], selection_scope="world"), ValueError, "unknown selection_scope 'world'"),
    ("unknown-row-score", lambda: Dion3([param(4, 4)], row_score="l3"), ValueError, "unknown row_score 'l3'"),
    ("unselected-decay-zero", lambda: Dion3([param(4, 4)], unselected_decay=0.0), ValueError,
     "parameter group 0: unselected_decay must lie in (0.0, 1.0], got 0.0"),
    ("unselected-decay-above-one", lambda: Dion3([{"params": [param(4, 4)], "unselected_decay": 1.5}]), ValueError,
     "unselected_decay must lie in (0.0, 1.0], got 1.5"),
    ("periodic-full-every-zero", lambda: PeriodicFull(0.5, every=0), ValueError, "PeriodicFull: every must be an integer ≥ 1, got 0"),
    ("periodic-full-fraction-zero", lambda: PeriodicFull(0.0, every=8), ValueError,
     "PeriodicFull: fraction must lie in (0.0, 1.0], got 0.0"),
    ("dion3-nesterov", lambda: Dion3([{"params": [param(4, 4)], "nesterov": True}]), ValueError, "Dion3 has no Nesterov variant"),
    ("dion2-nesterov", lambda: Dion3([{"params": [param(4, 4)], "algorithm": "dion2", "nesterov": True}]), ValueError,
     "Dion2 has no Nesterov variant"),
    ("num-heads-not-dividing-rows", lambda: Muon([("attn.qkv", param(12, 8))], num_heads=5), ValueError,
     "parameter 'attn.qkv' has 12 rows, which num_heads=5 does not split into equal heads"),
    ("num-heads-of-3d-batch", lambda: NorMuon([param(2, 12, 8)], num_heads=8, stacked=True), ValueError,
     "has 12 rows, which num_heads=8"),
    ("split-sizes-wrong-sum", lambda: Dion3([("mlp.gate_up", param(12, 8))], split_sizes=(6, 4)), ValueError,
     "parameter 'mlp.gate_up' has 12 rows, but split_sizes=(6, 4) sum to 10"),
    ("split-sizes-flattened-rows", lambda: Muon([param(8, 3, 2, 2)], flatten=True, split_sizes=(4, 2)), ValueError,
     "has 8 rows, but split_sizes=(4, 2) sum to 6"),
    ("split-sizes-not-positive", lambda: Muon([param(12, 8)], split_sizes=(12, 0)), ValueError, "split_sizes must hold positive integers"),
    ("split-sizes-not-integers", lambda: Muon([param(12, 8)], split_sizes=(6.0, 6.0)), ValueError, "split_sizes must hold positive integers"),
    ("split-sizes-not-a-sequence", lambda: Dion3([param(12, 8)], split_sizes=12), ValueError, "split_sizes must be a non-empty sequence"),
    ("num-heads-not-positive", lambda: Dion3([param(12, 8)], num_heads=0), ValueError, "num_heads must be a positive integer or None"),
    ("num-heads-and-split-sizes", lambda: Muon([{"params": [param(12, 8)], "num_heads": 2, "split_sizes": (6, 6)}]), ValueError,
     "num_heads and split_sizes are both set"),
    ("nan-gradient-check-finite", lambda: step_with_grad(float("nan")), FloatingPointError, "non-finite gradient in parameter 'w'"),
    ("inf-gradient-check-finite", lambda: step_with_grad(float("inf")), FloatingPointError, "non-finite gradient in parameter 'w'"),
    ("overflowing-gradient-norm-check-finite", lambda: step_with_grad(1e20), FloatingPointError, "its norm overflows float32"),
    ("sparse-gradient-adamw", sparse_gradient_in("adamw"), ValueError,
     "parameter 'embed.weight' of group 0 has a sparse gradient, which an AdamW or Lion group cannot step"),
    ("sparse-gradient-lion", sparse_gradient_in("lion"), ValueError, "'embed.weight' of group 0 has a sparse gradient"),
    ("orthogonalize-vector", lambda: orthogonalize(torch.randn(4)), ValueError, "needs a [..., rows, cols] tensor"),
    ("orthogonalize-integer", lambda: orthogonalize(torch.ones(4, 4, dtype=torch.int64)), ValueError, "real floating-point tensor"),
    ("orthogonalize-unknown-method", lambda: orthogonalize(torch.randn(4, 4), method="svd"), ValueError, "unknown orthogonalization method 'svd'"),
    ("orthogonalize-norm-shape", lambda: orthogonalize(torch.randn(3, 4, 6), norm=torch.ones(3)), ValueError, "norm must have shape (3, 1, 1)"),
    ("orthogonalize-normalized-dtype", lambda: orthogonalize(torch.randn(4, 6, dtype=torch.float64), dtype=torch.float32, normalized=True),
     ValueError, "normalized=True needs an input in the compute dtype"),
    ("gram-restart-out-of-range", lambda: orthogonalize(torch.randn(4, 16), method="gram", restarts=[5]), ValueError, "restart positions must lie in 1..4"),
    ("state-dict-group-count", lambda: load_into([(4, 6)]), ValueError, "state dict has 2 parameter groups but this optimizer has 1"),
    ("state-dict-param-count", lambda: load_into([(4, 6), (3, 5), (2, 2)]), ValueError, "has 2 parameters but this optimizer's has 3"),
    ("state-dict-shape", lambda: load_into([(6, 4), (3, 5)]), ValueError, "has shape (4, 6) in the state dict, expected (6, 4)"),
    ("state-dict-missing-entry", lambda: load_into([(4, 6), (3, 5)], drop_variance), ValueError, "state dict has no 'variance'"),
    ("state-dict-other-algorithm", muon_state_into_dion3, ValueError,
     "parameter group 0 of the state dict was saved by algorithm 'muon', but this optimizer runs 'dion3' there"),
    ("state-dict-not-an-optimizer-state", lambda: load_into([(4, 6), (3, 5)], lambda sd: sd.pop("state")), ValueError, "must have 'state' and 'param_groups'"),
    ("state-dict-from-torch-adamw", lambda: torch_state_into_dion3(torch.optim.AdamW), ValueError,
     "for parameter 'w' of group 0 it holds exp_avg/exp_avg_sq, as torch.optim.AdamW saves, where this optimizer's "
     "'dion3' keeps momentum/variance"),
    ("state-dict-from-torch-sgd", lambda: torch_state_into_dion3(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
     ValueError, "it holds momentum_buffer, as torch.optim.SGD saves"),
    ("state-dict-from-unstepped-torch-optimizer", lambda: torch_state_into_dion3(torch.optim.AdamW, steps=0), ValueError,
     "its group 0 holds no state, and settings of torch.optim (lr, betas, eps"),
]


@pytest.mark.parametrize("action, error, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_its_documented_error(action, error, fragment):
    with pytest.raises(error) as caught:
        action()
    assert fragment in str(caught.value)


# "name_with_underscore: ...": a function name heading a message. Only what the caller wrote
# may head one: the public names of dion3 (param_groups, convert_state_dict, ...).
HEADING_NAME = re.compile(r"\b([A-Za-z]\w*_\w*):")


@pytest.mark.parametrize("action, error", [c[1:3] for c in CASES], ids=[c[0] for c in CASES])
def test_every_message_names_each_group_once_and_no_function_inside(action, error):
    import dion3

    with pytest.raises(error) as caught:
        action()
    message = str(caught.value)
    # one group per number: "parameter group 0: parameter 0 of group 0" would name group 0 twice
    named = re.findall(r"\bgroups? (\d+)", message)
    assert len(named) == len(set(named)), f"a group is named twice: {message}"
    assert message.count("of group") <= 1, message
    inside = [name for name in HEADING_NAME.findall(message) if not hasattr(dion3, name)]
    assert not inside, f"the message names {inside}, which the caller never called: {message}"


def test_the_checks_catch_what_they_are_for():
    """The two patterns above, on messages as they read before they were fixed."""
    repeated = "parameter group 0: parameter 2 of group 0 (shape (32,)) is 1-D"
    named = re.findall(r"\bgroups? (\d+)", repeated)
    assert len(named) != len(set(named))
    import dion3

    inside = "cost_allocated_fractions: fraction must lie in (0, 1], got 0"
    assert [n for n in HEADING_NAME.findall(inside) if not hasattr(dion3, n)] == ["cost_allocated_fractions"]
    assert [n for n in HEADING_NAME.findall("param_groups: lm_head 'x' names no module") if not hasattr(dion3, n)] == []


def test_table_has_unique_ids_and_every_row_is_documented():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 12
    doc = DOC.read_text()
    missing = [i for i in ids if f"`{i}`" not in doc]
    assert not missing, f"rows missing from {DOC}: {missing}"


def test_flatten_refuses_a_parameter_whose_rows_cannot_be_viewed_in_place():
    # A channels_last conv weight cannot be reshaped to [out, -1] without a copy: the optimizer
    # would update the copy and leave the parameter untouched. It must refuse it up front.
    conv = torch.nn.Conv2d(4, 8, 3, bias=False).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="flatten=True"):
        Muon([conv.weight], flatten=True)


def test_muon_rejects_a_misspelled_keyword_instead_of_ignoring_it():
    weight = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(TypeError, match="nesterv"):
        Muon([weight], nesterv=True)
    with pytest.raises(TypeError, match="weight_decy"):
        NorMuon([weight], weight_decy=0.0)
    # settings of the other algorithms stay accepted (groups may switch algorithm)
    Muon([weight], fraction=0.5, muon_beta2=0.9, selection_scope="global")


def test_a_misspelled_group_key_is_refused_with_the_key_it_resembles():
    w = param(4, 4)
    with pytest.raises(ValueError, match=re.escape("parameter group 0 has an unknown key 'fracton' (did you mean 'fraction'?)")):
        Dion3([{"params": [w], "fracton": 0.5}])
    with pytest.raises(ValueError, match=re.escape("unknown key 'momentum' (did you mean 'mu'?)")):  # torch's name
        Muon([{"params": [w], "momentum": 0.9}])
    opt = NorMuon([w])
    with pytest.raises(ValueError, match=re.escape("parameter group 1 has an unknown key 'weight_decy' (did you mean 'weight_decay'?)")):
        opt.add_param_group({"params": [param(3, 3)], "weight_decy": 0.0})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="unknown key 'colour', which would be ignored; a group may hold adjust_lr, "):
        Dion3([{"params": [w], "colour": "red"}])


def test_the_keys_dion3_and_torch_write_into_groups_are_accepted():
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 16))
    for allocation in ("uniform", "cost"):
        groups = param_groups(model, lm_head="3", fraction=0.5, fraction_allocation=allocation, mu=0.9)
        Dion3(groups)
    w = param(4, 4)
    opt = Muon([{"params": [w], "fraction": 0.5, "muon_beta2": 0.9, "selection_scope": "global", "momentum_dtype": "bf16",
                 "num_heads": 2, "initial_lr": 0.01}])
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10, cycle_momentum=False)
    Muon(opt.param_groups)  # groups copied from a running optimizer (scheduler keys included)


@pytest.mark.parametrize("shapes, edit", [([(4, 6)], None), ([(6, 4), (3, 5)], None), ([(4, 6), (3, 5)], drop_variance)])
def test_rejected_state_dict_leaves_the_optimizer_untouched(shapes, edit):
    state_dict = stepped_state_dict()
    if edit is not None:
        edit(state_dict)
    opt = Dion3([param(*s) for s in shapes]) if len(shapes) == 1 else two_groups(shapes)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError):
        opt.load_state_dict(state_dict)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for pid, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)


def test_rejected_param_group_leaves_the_optimizer_usable():
    w = param(4, 4)
    opt = Dion3([w], lr=0.1)
    with pytest.raises(ValueError, match="fraction"):
        opt.add_param_group({"params": [param(3, 3)], "fraction": 2.0})
    assert len(opt.param_groups) == 1
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    opt.step()
    assert torch.isfinite(w).all() and not torch.equal(w, before)


def test_a_group_naming_a_parameter_as_another_group_does_is_refused_when_added():
    first = torch.nn.Linear(4, 4, bias=False)
    opt = Dion3(param_groups(first, lm_head=False))
    with pytest.raises(ValueError, match=re.escape("parameter group 1 names a parameter 'weight', and so does parameter group 0")):
        opt.add_param_group({"params": [("weight", param(4, 4))]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [param(4, 4)], "param_names": ["second.weight"]})  # a name of its own


def test_a_sparse_gradient_leaves_an_adamw_group_untouched():
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = Dion3([{"params": [embedding.weight], "algorithm": "adamw", "lr": 0.1}])
    embedding(torch.tensor([1, 3])).sum().backward()
    weights, state = embedding.weight.detach().clone(), copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="sparse gradient"):
        opt.step()
    assert torch.equal(embedding.weight, weights)
    assert all(torch.equal(value, state["state"][0][key]) for key, value in opt.state_dict()["state"][0].items())


@pytest.mark.parametrize("make", [
    lambda params: Dion3(params, lr=0.1, fraction=0.25),
    lambda params: Dion3(params, lr=0.1, check_finite=True),
    lambda params: Muon(params, lr=0.1),
    lambda params: NorMuon(params, lr=0.1),
], ids=["dion3-quarter", "dion3-check-finite", "muon", "normuon"])
def test_a_sparse_gradient_in_a_matrix_group_steps_as_its_dense_gradient(make):
    """The reference is the same run with nn.Embedding(sparse=False): equal bit for bit."""
    weights = []
    for sparse in (True, False):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(16, 8, sparse=sparse)
        other = param(16, 8)
        opt = make([embedding.weight, other])
        for tokens in ([1, 3], [3, 3, 7]):
            opt.zero_grad()
            (embedding(torch.tensor(tokens)).sum() + other.square().sum()).backward()
            opt.step()
        weights.append(embedding.weight.detach().clone())
    assert not torch.equal(weights[1], torch.nn.Embedding(16, 8).weight)
    assert torch.equal(weights[0], weights[1])


def test_each_documented_row_quotes_the_message_its_case_asserts():
    """docs/errors.md's row of each case holds the fragment the case asserts, so the doc cannot
    keep an old message while the code and its test move on."""
    rows = {line.split("|")[1].strip().strip("`"): line for line in DOC.read_text().splitlines()
            if line.startswith("| `")}
    stale = [case[0] for case in CASES if case[3] not in rows.get(case[0], "").replace("\\|", "|")]
    assert not stale, f"rows of {DOC} whose message is not the one their case asserts: {stale}"
