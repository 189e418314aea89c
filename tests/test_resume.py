"""Single-device checkpoints: a resumed run is the run that never stopped.

A small model with every kind of group (matrices, a 3-D batch of matrices, a flattened conv
weight, AdamW and Lion groups) is trained N steps straight, and N/2 steps + checkpoint through
torch.save/torch.load into a *fresh* model and optimizer + N/2 steps. On CPU the two must agree
bit for bit. Checkpoints also survive a change of parameter dtype (momentum follows the
parameter, the per-row variance stays float32), and a checkpoint of a different model is
refused with a clear error.
"""
from __future__ import annotations

import copy
import pytest
import torch
from torch import nn

from dion3 import Dion3, Muon, NorMuon

VOCAB, WIDTH, HIDDEN, EXPERT = 16, 8, 12, 6


class TinyModel(nn.Module):
    def __init__(self, hidden: int = HIDDEN, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.inp = nn.Linear(WIDTH, hidden)
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.experts = nn.Parameter(torch.randn(3, hidden, EXPERT) / hidden**0.5)  # a 3-D batch
        self.mix = nn.Conv2d(EXPERT, EXPERT, 1)  # 4-D weight: flattened to a matrix
        self.head = nn.Linear(EXPERT, VOCAB, bias=False)

    def forward(self, tokens):
        h = torch.tanh(self.inp(self.embed(tokens)))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        e = torch.einsum("btd,ndk->btk", h, self.experts)
        e = self.mix(e.permute(0, 2, 1).unsqueeze(-1)).squeeze(-1).permute(0, 2, 1)
        return self.head(e)

    def param_groups(self, matrix_algorithm_options=None):
        matrices = [self.inp.weight, *(b.weight for b in self.blocks), self.experts]
        biases = [self.inp.bias, self.mix.bias, *(b.bias for b in self.blocks)]
        return [
            {"params": matrices, "stacked": True, **(matrix_algorithm_options or {})},  # experts: a stack
            {"params": [self.mix.weight], "flatten": True},
            {"params": [self.embed.weight, self.head.weight], "algorithm": "adamw", "lr": 3e-3},
            {"params": biases, "algorithm": "lion", "lr": 1e-3},
        ]


def make(factory, options, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = TinyModel().to(dtype)
    return model, factory(model.param_groups(), **options)


def batches(count, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, 10), generator=gen) for _ in range(count)]


def train(model, opt, data, scheduler=None):
    for tokens in data:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


OPTIMIZERS = {
    "dion3-quarter": (Dion3, dict(lr=0.02, fraction=0.25)),
    "dion3-odd-fraction": (Dion3, dict(lr=0.02, fraction=0.3, orthogonalizer="gram", ns_coefficients="you")),
    "muon-nesterov": (Muon, dict(lr=0.02, nesterov=True, adjust_lr="rms_norm")),
    "normuon": (NorMuon, dict(lr=0.02, muon_beta2=0.9)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_through_a_file_is_bit_exact(name, tmp_path):
    factory, options = OPTIMIZERS[name]
    steps = 8
    data = batches(steps)

    straight_model, straight_opt = make(factory, options)
    train(straight_model, straight_opt, data)

    model, opt = make(factory, options)
    train(model, opt, data[: steps // 2])
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    del model, opt

    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model, opt = make(factory, options, seed=123)  # different initial weights: all must come from the file
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optim"])
    train(model, opt, data[steps // 2 :])

    for (key, a), b in zip(straight_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), key
    for pid, entry in straight_opt.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(opt.state_dict()["state"][pid][key], value), (pid, key)


def test_resume_with_tensor_lr_and_scheduler_is_bit_exact(tmp_path):
    def options():  # a fresh lr tensor per optimizer: schedulers write into it
        return dict(lr=torch.tensor(0.02), fraction=0.5)

    steps = 8
    data = batches(steps, seed=7)

    def scheduler_for(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    straight_model, straight_opt = make(Dion3, options())
    train(straight_model, straight_opt, data, scheduler_for(straight_opt))

    model, opt = make(Dion3, options())
    scheduler = scheduler_for(opt)
    train(model, opt, data[: steps // 2], scheduler)
    torch.save(
        {"model": model.state_dict(), "optim": opt.state_dict(), "sched": scheduler.state_dict()},
        tmp_path / "ckpt.pt",
    )
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model, opt = make(Dion3, options(), seed=5)
    scheduler = scheduler_for(opt)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optim"])
    scheduler.load_state_dict(checkpoint["sched"])
    train(model, opt, data[steps // 2 :], scheduler)

    assert float(opt.param_groups[0]["lr"]) == float(straight_opt.param_groups[0]["lr"])
    for (key, a), b in zip(straight_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), key


def matrix_params(model):
    return [model.inp.weight, *(b.weight for b in model.blocks), model.experts, model.mix.weight]


@pytest.mark.parametrize("saved_dtype, loaded_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_state_survives_a_parameter_dtype_change(saved_dtype, loaded_dtype):
    data = batches(3)
    model, opt = make(Dion3, dict(lr=0.02), dtype=saved_dtype)
    train(model, opt, data)
    saved = opt.state_dict()

    model2, opt2 = make(Dion3, dict(lr=0.02), dtype=loaded_dtype)
    for p in matrix_params(model2):  # fresh state is already laid out by dtype
        assert opt2.state[p]["momentum"].dtype == loaded_dtype
        assert opt2.state[p]["variance"].dtype == torch.float32
    opt2.load_state_dict(saved)
    loaded = opt2.state_dict()
    for pid, entry in saved["state"].items():
        for key, value in entry.items():
            got = loaded["state"][pid][key]
            if key == "variance":  # per-row second moments keep full precision
                assert got.dtype == torch.float32 and torch.equal(got, value)
            elif key == "step":
                assert got.dtype == torch.float32 and torch.equal(got, value)
            else:  # moments follow the parameter dtype: exactly the saved values, rounded once
                assert got.dtype == loaded_dtype and torch.equal(got, value.to(loaded_dtype))
    # the loaded state is the state the step uses: one more step runs and stays finite
    train(model2, opt2, batches(1, seed=9))
    assert all(torch.isfinite(p).all() for p in model2.parameters())


def test_bf16_continuation_tracks_fp32_and_uses_the_loaded_state():
    """NorMuon (no selection, so rounding cannot flip a discrete choice) on fixed gradients:
    after N/2 fp32 steps, continuing with bf16 parameters from the checkpoint moves the weights
    almost as continuing in fp32 does, and much closer than bf16 from fresh state would."""
    shapes = [(16, 32), (32, 16), (2, 24, 24)]
    gen = torch.Generator().manual_seed(4)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(10)]

    def run(params, opt, steps):
        for step_grads in steps:
            for p, g in zip(params, step_grads):
                p.grad = g.to(p.dtype)
            opt.step()

    def start(dtype, values=None):
        params = [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
        if values is not None:
            for p, v in zip(params, values):
                p.data.copy_(v)
        return params, NorMuon(params, lr=0.02, weight_decay=0.0, stacked=True)

    params, opt = start(torch.float32)
    run(params, opt, grads[:5])
    checkpoint = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))  # state_dict() holds live views
    run(params, opt, grads[5:])
    moved = [p.detach().double() - c.double() for p, c in zip(params, checkpoint[0])]

    def continue_in_bf16(load_optimizer_state: bool) -> float:
        bf16_params, bf16_opt = start(torch.bfloat16, checkpoint[0])
        if load_optimizer_state:
            bf16_opt.load_state_dict(checkpoint[1])
        run(bf16_params, bf16_opt, grads[5:])
        return max(
            ((p.detach().double() - c.to(torch.bfloat16).double() - m).norm() / m.norm()).item()
            for p, c, m in zip(bf16_params, checkpoint[0], moved)
        )

    resumed, fresh = continue_in_bf16(True), continue_in_bf16(False)
    assert resumed < 3e-2, resumed
    assert fresh > 3 * resumed, (fresh, resumed)


@pytest.mark.parametrize(
    "changed_model, fragment",
    [
        (lambda: TinyModel(hidden=HIDDEN + 4), "in the state dict, expected"),
        (lambda: TinyModel(layers=3), "parameters but this optimizer's has"),
    ],
    ids=["wider-model", "deeper-model"],
)
def test_checkpoint_of_another_model_is_refused(changed_model, fragment, tmp_path):
    model, opt = make(Dion3, dict(lr=0.02))
    train(model, opt, batches(1))
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    other = changed_model()
    other_opt = Dion3(other.param_groups(), lr=0.02)
    with pytest.raises(ValueError, match="the state dict does not match these parameters") as caught:
        other_opt.load_state_dict(torch.load(tmp_path / "optim.pt", weights_only=True))
    assert fragment in str(caught.value)


def test_dropping_a_group_is_refused(tmp_path):
    model, opt = make(Muon, dict(lr=0.02))
    groups = model.param_groups()
    fewer = Muon(groups[:2] + groups[3:], lr=0.02)  # no AdamW group
    with pytest.raises(ValueError, match="state dict has 4 parameter groups but this optimizer has 3"):
        fewer.load_state_dict(opt.state_dict())
