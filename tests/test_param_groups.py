"""dion3.param_groups reads the model's modules: convolution kernels are one (out, in·k) matrix each,
other 3-D parameters are stacks of matrices, a compiled model gives the plain model's groups, and
AdamW/Lion groups carry no setting of the orthogonal rules. Updates are checked against the
float64 reference (tests/reference.py) on the matrices each parameter is meant to be."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dion3 import Dion3, Muon, param_groups
from dion3.optim.validation import MATRIX_SETTINGS
from reference import ReferenceOptimizer


class ConvAndExperts(nn.Module):
    """A Conv1d and a Conv2d kernel, a linear weight and a 3-D expert stack, with biases."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, 3)  # kernel (8, 4, 3): one 8 × 12 matrix
        self.conv2 = nn.Conv2d(3, 6, 2)  # kernel (6, 3, 2, 2): one 6 × 12 matrix
        self.proj = nn.Linear(12, 8)
        self.experts = nn.Parameter(torch.randn(3, 8, 5))  # three 8 × 5 matrices


def _float64_model(seed: int = 0) -> ConvAndExperts:
    torch.manual_seed(seed)
    return ConvAndExperts().double()


@pytest.mark.parametrize("cls, algorithm, options", [
    (Dion3, "dion3", dict(fraction=0.5, mu=0.9)),
    (Muon, "muon", dict(mu=0.9)),
])
def test_conv_kernels_train_as_one_flattened_matrix_and_experts_as_a_stack(exact_orthogonalizer, cls, algorithm,
                                                                            options):
    model = _float64_model()
    groups = param_groups(model, lr=0.05, weight_decay=0.1, **options)
    optimizer = cls(groups)
    matrices = {"conv1.weight": (8, 12), "conv2.weight": (6, 12), "proj.weight": (8, 12), "experts": (3, 8, 5)}
    params = dict(model.named_parameters())
    # the reference steps each matrix on its own: the kernels as their flattened matrix
    reference = ReferenceOptimizer([params[n].detach().reshape(s) for n, s in matrices.items()], algorithm,
                                   lr=0.05, weight_decay=0.1, **options)
    # the reading this replaces: the Conv1d kernel as 8 separate 4 × 3 matrices
    misread = ReferenceOptimizer([params["conv1.weight"].detach()], algorithm, lr=0.05, weight_decay=0.1, **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = {n: torch.randn(params[n].shape, generator=generator, dtype=torch.float64) for n in matrices}
        for name, p in params.items():
            p.grad = grads.get(name, torch.zeros_like(p))
        optimizer.step()
        reference.step([grads[n].reshape(s) for n, s in matrices.items()])
        misread.step([grads["conv1.weight"]])
    for (name, shape), expected in zip(matrices.items(), reference.params):
        torch.testing.assert_close(params[name].detach().reshape(shape), expected, rtol=2e-6, atol=2e-7, msg=name)
    # the test can tell the two readings apart
    assert not torch.allclose(params["conv1.weight"].detach(), misread.params[0], atol=1e-3)


def test_groups_say_how_each_parameter_is_read():
    groups = param_groups(ConvAndExperts(), fraction=0.25)
    by_name = {name: group for group in groups for name in group["param_names"]}
    assert by_name["conv1.weight"] is by_name["conv2.weight"]
    assert by_name["conv1.weight"]["flatten"] is True and "stacked" not in by_name["conv1.weight"]
    assert by_name["experts"] is by_name["proj.weight"]
    assert by_name["experts"]["stacked"] is True and "flatten" not in by_name["experts"]
    for group in (by_name["conv1.weight"], by_name["experts"]):
        assert group["fraction"] == 0.25
    assert by_name["conv1.bias"]["algorithm"] == "adamw"
    Dion3(groups)  # accepted as given


def _named_groups(groups):
    """Groups with their tensors replaced by identities, for comparing groups."""
    return [dict(g, params=[id(p) for p in g["params"]]) for g in groups]


def test_a_model_without_stacks_or_kernels_keeps_one_plain_matrix_group():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    matrix = _named_groups(param_groups(model, fraction=0.25))[0]
    assert matrix == {"fraction": 0.25, "params": [id(model[0].weight), id(model[2].weight)],
                      "param_names": ["0.weight", "2.weight"]}


def test_flatten_among_the_options_flattens_every_matrix_in_one_group():
    model = ConvAndExperts()
    matrix = param_groups(model, flatten=True)[0]
    assert matrix["param_names"] == ["experts", "conv1.weight", "conv2.weight", "proj.weight"]
    assert matrix["flatten"] is True and "stacked" not in matrix


def test_a_convolution_shares_its_shapes_fraction_under_cost_allocation():
    """With fraction_allocation="cost", a kernel (1024, 256, 3) is priced as the 1024 × 768 matrix it is:
    its model gets the fractions of a twin model with a Linear(768, 1024) in its place, name for name."""
    def build(conv: bool) -> nn.Module:
        model = nn.Module()
        model.mix = nn.Conv1d(256, 1024, 3, bias=False) if conv else nn.Linear(768, 1024, bias=False)
        model.same = nn.Linear(768, 1024, bias=False)  # the kernel's flattened shape
        model.up = nn.Linear(1024, 4096, bias=False)
        model.down = nn.Linear(4096, 1024, bias=False)
        model.short = nn.Linear(1024, 256, bias=False)
        return model

    with torch.device("meta"):
        groups = [param_groups(build(conv), fraction=0.25, fraction_allocation="cost") for conv in (True, False)]
    fractions = [{name: g["fraction"] for g in gs for name in g["param_names"]} for gs in groups]
    assert fractions[0] == fractions[1]
    assert len(set(fractions[0].values())) > 1  # the allocation did move rows between shapes
    groups = groups[0]
    (kernel_group,) = [g for g in groups if "mix.weight" in g["param_names"]]
    assert kernel_group["flatten"] is True and kernel_group["param_names"] == ["mix.weight"]


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.block = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Conv1d(8, 8, 1))
        self.lm_head = nn.Linear(8, 32, bias=False)


# torch.compile imports torch._dynamo, which warns of torch.jit's deprecation on its own
COMPILE_IMPORT = pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")


@COMPILE_IMPORT
@pytest.mark.parametrize("options", [dict(), dict(fraction=0.25, fraction_allocation="cost"), dict(algorithm="adamw")])
def test_a_compiled_model_gives_the_plain_models_groups(options):
    model = TinyLM()
    compiled = torch.compile(model)  # built, never run
    assert any("_orig_mod." in name for name, _ in compiled.named_parameters())
    expected = _named_groups(param_groups(model, lm_head="lm_head", **options))
    assert _named_groups(param_groups(compiled, lm_head="lm_head", **options)) == expected
    # a submodule compiled on its own, and the head named as the compiled model spells it
    model.block = torch.compile(model.block)
    assert _named_groups(param_groups(model, lm_head="lm_head", **options)) == expected
    assert _named_groups(param_groups(compiled, lm_head="_orig_mod.lm_head", **options)) == expected


@COMPILE_IMPORT
def test_a_compiled_model_refuses_an_unnamed_head_by_its_plain_name():
    with pytest.raises(ValueError, match=r"but 'lm_head' projects 8 features onto the 32-token vocabulary of "
                                         r"embedding 'embed': name it \(lm_head='lm_head'\)"):
        param_groups(torch.compile(TinyLM()))


@pytest.mark.parametrize("algorithm", ["adamw", "lion"])
def test_scalar_groups_carry_no_setting_of_the_orthogonal_rules(algorithm):
    groups = param_groups(ConvAndExperts(), algorithm=algorithm, scalar_algorithm=algorithm, lr=0.01, fraction=0.25,
                          mu=0.9, weight_decay=0.05, betas=(0.8, 0.9), momentum_dtype="bfloat16", flatten=False)
    assert all(g["algorithm"] == algorithm for g in groups)
    assert not [key for g in groups for key in g if key in MATRIX_SETTINGS]
    (matrices,) = [g for g in groups if "conv1.weight" in g["param_names"]]  # every matrix, as it is
    assert matrices["param_names"] == ["experts", "conv1.weight", "conv2.weight", "proj.weight"]
    assert (matrices["lr"], matrices["weight_decay"], matrices["betas"]) == (0.01, 0.05, (0.8, 0.9))
    Dion3(groups)


def test_a_misspelled_option_still_reaches_a_scalar_group_and_is_refused():
    with pytest.raises(ValueError, match=r"unknown key 'weight_decy' \(did you mean 'weight_decay'\?\)"):
        Dion3(param_groups(ConvAndExperts(), algorithm="adamw", weight_decy=0.1))


@pytest.mark.parametrize("cls", [Dion3, Muon])
def test_matrix_settings_are_the_settings_scalar_groups_do_not_read(cls):
    """MATRIX_SETTINGS (what param_groups leaves out of AdamW/Lion groups) are every setting of the
    optimizers but the four that the AdamW and Lion steps read, and the algorithm."""
    defaults = set(cls([torch.zeros(2, 2, requires_grad=True)]).defaults)
    assert set(MATRIX_SETTINGS) == defaults - {"algorithm", "lr", "betas", "weight_decay", "epsilon"}


class AttentionAndMLP(nn.Module):
    """q/o 16 × 16, k 8 × 16, an MLP 24 × 16 and 16 × 24: shapes on which fractions by cost and
    with the most rows differ (0.8125, 0.75, 1/6, 1/8 against 0.3125, 1, 0.21, 1 at ½)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.o = nn.Linear(16, 16, bias=False), nn.Linear(16, 8, bias=False), nn.Linear(16, 16, bias=False)
        self.up, self.down = nn.Linear(16, 24, bias=False), nn.Linear(24, 16, bias=False)


@pytest.mark.parametrize("allocation", ["cost", "most_rows"])
def test_fractions_by_cost_step_each_matrix_at_its_own_fraction_as_the_float64_reference(exact_orthogonalizer,
                                                                                         allocation):
    """param_groups' per-shape fractions reach the step: each matrix moves as the float64 reference
    of Dion3 at its group's fraction (the rows ⌈f·rows⌉), and one uniform ½ would not."""
    torch.manual_seed(0)
    model = AttentionAndMLP().double()
    groups = param_groups(model, lm_head=False, lr=0.05, mu=0.9, weight_decay=0.1, fraction=0.5,
                          fraction_allocation=allocation)
    fractions = {n: g["fraction"] for g in groups for n in g["param_names"]}
    assert len(set(fractions.values())) >= 3 and 0.5 not in fractions.values()
    optimizer = Dion3(groups)
    params = dict(model.named_parameters())
    references = {n: ReferenceOptimizer([p.detach()], "dion3", lr=0.05, mu=0.9, weight_decay=0.1,
                                     fraction=fractions[n])
                  for n, p in params.items()}
    uniform = ReferenceOptimizer([p.detach() for p in params.values()], "dion3", lr=0.05, mu=0.9, weight_decay=0.1,
                                 fraction=0.5)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=generator, dtype=torch.float64) for n, p in params.items()}
        for name, p in params.items():
            p.grad = grads[name]
            references[name].step([grads[name]])
        uniform.step(list(grads.values()))
        optimizer.step()
    for name, p in params.items():
        torch.testing.assert_close(p.detach(), references[name].params[0], rtol=2e-6, atol=2e-7, msg=name)
    assert not all(torch.allclose(p.detach(), u, atol=1e-4) for p, u in zip(params.values(), uniform.params))


class Conv1D(nn.Module):
    """Hugging Face's Conv1D as transformers defines it (GPT-2): a linear map of nx inputs to nf
    outputs whose weight is stored [nx, nf] and applied as x @ W + b."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


def test_a_conv1d_map_gets_its_own_group_with_the_transposed_spectral_scale():
    model = nn.Sequential(nn.Linear(8, 16), Conv1D(32, 16), Conv1D(8, 32))
    groups = {tuple(g["param_names"]): g for g in param_groups(model)}
    assert "adjust_lr" not in groups[("0.weight",)]  # the optimizer's own (spectral_norm by default)
    assert groups[("1.weight", "2.weight")]["adjust_lr"] == "spectral_norm_transposed"
    assert groups[("0.bias", "1.bias", "2.bias")]["algorithm"] == "adamw"
    # the symmetric scales stay; the spectral one turns over either way
    for asked, given in (("rms_norm", "rms_norm"), (None, None), ("spectral_norm", "spectral_norm_transposed")):
        groups = {tuple(g["param_names"]): g for g in param_groups(model, adjust_lr=asked)}
        assert groups[("0.weight",)]["adjust_lr"] == asked and groups[("1.weight", "2.weight")]["adjust_lr"] == given
    # AdamW on the matrices, or every matrix flattened: no transposed group
    assert [g["param_names"] for g in param_groups(model, algorithm="adamw")][0] == ["0.weight", "1.weight", "2.weight"]


def test_the_transposed_spectral_scale_is_the_maps_own(exact_orthogonalizer):
    """A map of 16 inputs to 48 outputs stored [in, out] steps under Muon exactly as the float64
    reference steps the same map stored [out, in] (√(48/16) = √3, where the stored shape's
    spectral scale would give √(16/48)); under Dion3 the stored rows (the inputs) are the
    selected and normalized ones, at the map's lr scale."""
    for algorithm, cls, options in (("muon", Muon, dict(mu=0.9)), ("dion3", Dion3, dict(fraction=0.5, mu=0.9))):
        torch.manual_seed(0)
        model = nn.Sequential(Conv1D(48, 16)).double()
        stored = model[0].weight
        optimizer = cls(param_groups(model, lr=0.05, weight_decay=0.1, **options))
        if algorithm == "muon":  # the map [out, in] = [48, 16], the spectral scale of that shape
            reference = ReferenceOptimizer([stored.detach().T.clone()], algorithm, lr=0.05, weight_decay=0.1, **options)
        else:  # the stored rows, at the map's scale √(out/in) given by hand
            reference = ReferenceOptimizer([stored.detach().clone()], algorithm, lr=0.05 * 3 ** 0.5, adjust_lr=None,
                                           weight_decay=0.1 * 3 ** -0.5, **options)
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            grad = torch.randn(stored.shape, generator=generator, dtype=torch.float64)
            stored.grad, model[0].bias.grad = grad, torch.zeros_like(model[0].bias)
            optimizer.step()
            reference.step([grad.T.clone() if algorithm == "muon" else grad])
        expected = reference.params[0].T if algorithm == "muon" else reference.params[0]
        torch.testing.assert_close(stored.detach(), expected, rtol=1e-7, atol=1e-8, msg=algorithm)
