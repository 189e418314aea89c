"""Zero padding of the orthogonalized matrices (dion3.ortho.padding) is exact: forced on the CPU
(set_padding) for odd row counts k, the padded path gives the unpadded float64 math, in
Newton–Schulz, in the optimizer step (wide and tall selections, num_heads / split_sizes
blocks, expert stacks, captured steps) and on gloo DDP and FSDP2; on a GPU, where padding is
on by default for half precision, the padded step matches the unpadded one to half-precision
rounding."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dion3 import Dion3, Muon, NorMuon
from dion3.ortho import orthogonalize
from dion3.ortho.newton_schulz import orthogonalize_padded
from dion3.ortho.padding import padded_shape, set_padding

sys.path.insert(0, str(Path(__file__).parent))
from graph_standin import CPUCapturedStep  # noqa: E402
from reference import ReferenceOptimizer  # noqa: E402


@pytest.fixture
def padding():
    """set_padding for one test, restored after it."""
    yield set_padding
    set_padding(None)


def test_the_rule_pads_half_precision_on_cuda_only(padding):
    assert padded_shape(2675, 4096, torch.device("cuda"), torch.float16) == (2688, 4096)
    assert padded_shape(4096, 2675, torch.device("cuda"), torch.bfloat16) == (4096, 2688)
    assert padded_shape(1001, 3001, torch.device("cuda"), torch.bfloat16) == (1024, 3008)
    assert padded_shape(68, 3001, torch.device("cuda"), torch.float16) == (128, 3008)
    assert padded_shape(2675, 4096, torch.device("cuda"), torch.float32) == (2675, 4096)
    assert padded_shape(2675, 4096, torch.device("cpu"), torch.float16) == (2675, 4096)
    padding(8)
    assert padded_shape(13, 29, torch.device("cpu"), torch.float64) == (16, 32)
    padding("off")
    assert padded_shape(2675, 4096, torch.device("cuda"), torch.float16) == (2675, 4096)
    with pytest.raises(ValueError, match="padding"):
        padding(0)
    with pytest.raises(ValueError, match="padding"):
        padding("eight")


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize("shape", [(7, 13), (13, 7), (1, 9), (5, 5), (3, 64), (2, 3, 17)])
def test_newton_schulz_on_a_zero_padded_buffer_is_exact(padding, method, shape):
    x = torch.randn(shape, dtype=torch.float64)
    padding("off")
    plain = orthogonalize(x, method)
    padding(8)
    padded = orthogonalize(x, method)
    torch.testing.assert_close(padded, plain, rtol=1e-12, atol=1e-12)
    buffer = orthogonalize_padded(x.reshape(-1, *shape[-2:]), method)
    rows, cols = shape[-2:]
    assert buffer.is_padded and buffer.data.shape[-2] % 8 == 0 and buffer.data.shape[-1] % 8 == 0
    assert bool((buffer.data[:, rows:] == 0).all()) and bool((buffer.data[:, :, cols:] == 0).all())


CASES = {  # name: (optimizer, shapes, options); fraction 5/13 etc.: odd k on every matrix
    "dion3-wide": (Dion3, [(13, 29), (13, 29), (11, 40)], dict(fraction=0.37)),
    "dion3-tall": (Dion3, [(45, 9), (45, 9)], dict(fraction=0.6)),
    "dion3-heads": (Dion3, [(18, 20)], dict(fraction=0.4, num_heads=3)),
    "dion3-split": (Dion3, [(21, 16)], dict(fraction=0.5, split_sizes=(9, 5, 7))),
    "dion3-experts": (Dion3, [(3, 11, 24)], dict(fraction=0.3)),
    "dion3-global-f1": (Dion3, [(13, 29)], dict(fraction=1.0)),
    "muon": (Muon, [(13, 29), (29, 13)], {}),
    "normuon": (NorMuon, [(13, 29), (3, 11, 24)], {}),
}


def _train(factory, shapes, options, steps=3, captured=False):
    generator = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator, dtype=torch.float64)) for s in shapes]
    opt = factory(params, lr=0.03, weight_decay=0.1, stacked=True, **options)  # (3, 11, 24): three experts
    step = CPUCapturedStep(opt, warmup_steps=1) if captured else opt.step
    for i in range(steps):
        grads = torch.Generator().manual_seed(50 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads, dtype=torch.float64)
        step()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_padded_step_equals_the_unpadded_float64_step(padding, case):
    factory, shapes, options = CASES[case]
    padding("off")
    plain, _ = _train(factory, shapes, options)
    padding(8)
    padded, _ = _train(factory, shapes, options)
    for a, b in zip(padded, plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_padded_dion3_step_follows_the_reference_rules(padding):
    """Against the independent float64 reference (tests/reference.py), whose orthogonalizer is
    the unpadded Newton–Schulz: odd k = 5 of 13 rows, padded to 8."""
    shapes = [(13, 29), (13, 29)]
    generator = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator, dtype=torch.float64)) for s in shapes]

    def unpadded(x):
        padding("off")
        try:
            return orthogonalize(x, "auto")
        finally:
            padding(8)

    reference = ReferenceOptimizer(params, "dion3", lr=0.03, mu=0.95, weight_decay=0.1, fraction=0.37,
                                   orthogonalizer=unpadded)
    padding(8)
    opt = Dion3(params, lr=0.03, weight_decay=0.1, fraction=0.37)
    for i in range(3):
        grads = torch.Generator().manual_seed(50 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads, dtype=torch.float64)
        reference.step([p.grad for p in params])
        opt.step()
    for p, want in zip(params, reference.params):
        torch.testing.assert_close(p.detach(), want, rtol=1e-8, atol=1e-10)  # float64 sums in another order


@pytest.mark.parametrize("case", ["dion3-wide", "dion3-split", "normuon"])
def test_a_padded_captured_step_needs_no_host_sync(padding, case):
    factory, shapes, options = CASES[case]
    padding(8)
    eager, _ = _train(factory, shapes, options, steps=4)
    captured, _ = _train(factory, shapes, options, steps=4, captured=True)
    for a, b in zip(captured, eager):  # lr as a device scalar rounds lr·scale apart from the float lr
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    import gloo
    import padding_worker

    return gloo.spawn_and_read(padding_worker.worker, 2, tmp_path_factory.mktemp("padding") / "out.json")


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
@pytest.mark.parametrize("kind", ["dion3-global", "dion3-local", "normuon", "muon"])
def test_padded_distributed_steps_equal_the_unpadded_float64_step(distributed, layout, kind):
    """Padding forced on both gloo ranks; the reference is one process without padding."""
    assert distributed[f"{layout}/{kind}"] <= 1e-12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["dion3-wide", "dion3-tall", "dion3-split", "muon", "normuon"])
def test_gpu_padded_step_matches_the_unpadded_step(padding, case):
    """On CUDA the default pads the half-precision products; with padding off the same step runs
    on unaligned shapes. Both orthogonalize in half precision, so they agree to its rounding."""
    factory, shapes, options = CASES[case]
    shapes = [tuple(s * 37 for s in shape[-2:]) if len(shape) == 2 else (shape[0], *(s * 37 for s in shape[1:]))
              for shape in shapes]
    if "split_sizes" in options:
        options = dict(options, split_sizes=tuple(s * 37 for s in options["split_sizes"]))

    def train():
        generator = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s, generator=generator).cuda()) for s in shapes]
        before = [p.detach().clone() for p in params]
        opt = factory(params, lr=0.03, weight_decay=0.0, stacked=True, **options)
        for i in range(2):
            grads = torch.Generator().manual_seed(50 + i)
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads).cuda()
            opt.step()
        return [(p.detach() - b).double() for p, b in zip(params, before)]

    padding(None)  # the default rule: pads these unaligned shapes
    padded = train()
    padding("off")
    plain = train()
    for a, b in zip(padded, plain):
        assert float((a - b).norm() / b.norm()) <= 2e-2
