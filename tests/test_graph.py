"""CUDA-graph capture: the CPU-visible logic here, the capture itself when a GPU is present."""
import copy

import pytest
import torch

from dion3 import Dion3, Muon
from dion3.optim.graph import CapturedStep, require_grads, to_device_scalars


def _model_and_groups(device="cpu", seed=0):
    torch.manual_seed(seed)
    weights = [torch.nn.Parameter(torch.randn(s, device=device)) for s in [(12, 8), (12, 8), (6, 16), (3, 5, 7)]]
    bias = torch.nn.Parameter(torch.randn(12, device=device))
    return weights, bias


def _groups(weights, bias):
    return [dict(params=weights, stacked=True), dict(params=[bias], algorithm="adamw", lr=1e-2)]  # (3, 5, 7): a stack


def _fill_grads(params, step, device):
    gen = torch.Generator(device="cpu").manual_seed(1000 + step)
    for p in params:
        g = torch.randn(p.shape, generator=gen).to(device)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)


def test_refuses_cpu_parameters():
    weights, bias = _model_and_groups()
    with pytest.raises(ValueError, match="CUDA"):
        CapturedStep(Dion3(_groups(weights, bias)))


def test_refuses_check_finite_and_bad_warmup():
    weights, bias = _model_and_groups()
    with pytest.raises(ValueError, match="check_finite"):
        CapturedStep(Dion3(_groups(weights, bias), check_finite=True))
    with pytest.raises(ValueError, match="warmup_steps"):
        CapturedStep(Dion3(_groups(weights, bias)), warmup_steps=0)
    with pytest.raises(TypeError):
        CapturedStep(object())


def test_missing_gradient_is_named():
    weights, bias = _model_and_groups()
    opt = Muon([("w0", weights[0]), ("w1", weights[1])])
    weights[0].grad = torch.zeros_like(weights[0])
    with pytest.raises(RuntimeError, match="'w1'"):
        require_grads(opt)


def test_replay_gradient_sync_copies_only_replaced_gradients_and_names_missing_ones():
    """What a replay does with .grad before the graph runs (CPU-visible): nothing when every
    gradient is still the captured buffer; a gradient in a new tensor is copied into its
    buffer (and only that one); a parameter that lost its gradient is named."""
    weights, bias = _model_and_groups()
    params = weights + [bias]
    _fill_grads(params, 0, "cpu")
    step = object.__new__(CapturedStep)  # its constructor needs CUDA; the sync logic does not
    step.optimizer = Dion3(_groups(weights, bias))
    step._params = params
    step._static_grads = [p.grad for p in params]
    captured = [g.clone() for g in step._static_grads]
    step._sync_grads()
    assert all(p.grad is s for p, s in zip(params, step._static_grads))
    assert all(torch.equal(s, c) for s, c in zip(step._static_grads, captured))
    fresh = torch.randn(weights[1].shape)
    weights[1].grad = fresh
    step._sync_grads()
    assert torch.equal(step._static_grads[1], fresh) and step._static_grads[1] is not fresh
    assert all(torch.equal(step._static_grads[i], captured[i]) for i in (0, 2, 3, 4))
    bias.grad = None
    with pytest.raises(RuntimeError, match="no gradient"):
        step._sync_grads()


def test_device_scalars_follow_scheduler_and_match_float_hyperparameters():
    """lr / weight decay as tensors updated in place by a scheduler give exactly the steps that
    plain floats give; this is the state a captured graph reads."""
    w_float, b_float = _model_and_groups()
    w_tensor, b_tensor = copy.deepcopy(w_float), copy.deepcopy(b_float)
    opt_float = Dion3(_groups(w_float, b_float), lr=0.05, weight_decay=0.1)
    opt_tensor = Dion3(_groups(w_tensor, b_tensor), lr=0.05, weight_decay=0.1)
    to_device_scalars(opt_tensor, torch.device("cpu"))
    lr_objects = [g["lr"] for g in opt_tensor.param_groups]
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in lr_objects)
    sched_float = torch.optim.lr_scheduler.LambdaLR(opt_float, lambda s: 1.0 / (1 + s))
    sched_tensor = torch.optim.lr_scheduler.LambdaLR(opt_tensor, lambda s: 1.0 / (1 + s))
    for step in range(5):
        _fill_grads(w_float + [b_float], step, "cpu")
        _fill_grads(w_tensor + [b_tensor], step, "cpu")
        opt_float.step()
        opt_tensor.step()
        sched_float.step()
        sched_tensor.step()
    # the scheduler wrote into the same tensors (a graph holds their addresses)
    assert all(a is b for a, b in zip(lr_objects, [g["lr"] for g in opt_tensor.param_groups]))
    assert float(opt_tensor.param_groups[0]["lr"]) == pytest.approx(0.05 / 6)
    for a, b in zip(w_float + [b_float], w_tensor + [b_tensor]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fresh_grad_tensors", [False, True])
def test_captured_equals_eager_over_20_steps(fresh_grad_tensors):
    device = "cuda"
    w_eager, b_eager = _model_and_groups(device)
    w_graph, b_graph = copy.deepcopy(w_eager), copy.deepcopy(b_eager)
    opt_eager = Dion3(_groups(w_eager, b_eager), lr=0.05)
    opt_graph = Dion3(_groups(w_graph, b_graph), lr=0.05)
    to_device_scalars(opt_eager, torch.device(device))
    step = CapturedStep(opt_graph, warmup_steps=3)
    sched_eager = torch.optim.lr_scheduler.CosineAnnealingLR(opt_eager, T_max=20)
    sched_graph = torch.optim.lr_scheduler.CosineAnnealingLR(opt_graph, T_max=20)
    for i in range(20):
        if fresh_grad_tensors:
            for p in w_graph + [b_graph]:
                p.grad = None
        _fill_grads(w_eager + [b_eager], i, device)
        _fill_grads(w_graph + [b_graph], i, device)
        opt_eager.step()
        step()
        sched_eager.step()
        sched_graph.step()
    assert step.graph is not None
    for a, b in zip(w_eager + [b_eager], w_graph + [b_graph]):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def test_refuses_distributed_global_selection(tmp_path):
    """Global selection syncs split sizes through the host: capture must be refused up front."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        weights, bias = _model_and_groups()
        opt = Dion3(_groups(weights, bias), distributed_mesh=dist.group.WORLD, selection_scope="global")
        with pytest.raises(ValueError, match="selection_scope='global'"):
            CapturedStep(opt)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_equals_eager_on_kernel_sized_buckets():
    """Buckets big enough for every kernel path: 12 matrices of 2048² (standard NS, X·Xᵀ as a
    split product) and 4 of 1024×4096 (Gram NS, R = X·Xᵀ a long reduction with 4 stages)."""
    device = "cuda"
    torch.manual_seed(0)
    shapes = [(2048, 2048)] * 12 + [(1024, 4096)] * 4
    eager = [torch.nn.Parameter(torch.randn(s, device=device) / s[1] ** 0.5) for s in shapes]
    graph = copy.deepcopy(eager)
    opt_eager, opt_graph = Muon(eager, lr=0.02), Muon(graph, lr=0.02)
    to_device_scalars(opt_eager, torch.device(device))
    step = CapturedStep(opt_graph, warmup_steps=3)
    for i in range(6):
        _fill_grads(eager, i, device)
        _fill_grads(graph, i, device)
        opt_eager.step()
        step()
    assert step.graph is not None
    for a, b in zip(eager, graph):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def test_new_dtensor_gradients_are_copied_shard_to_shard(tmp_path):
    """FSDP2 and TP give each backward new DTensor gradients (zero_grad(set_to_none=True)): the
    replay copies them into the captured buffers through their local shards (torch's foreach
    copy has no DTensor rule); a gradient of another layout is refused naming the parameter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dion3.optim.graph import copy_grads

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
        opt = Muon([("attn.qkv", weight)], num_heads=2)
        buffer = distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)])
        fresh = torch.randn(6, 4)
        copy_grads(opt, [buffer], [distribute_tensor(fresh, mesh, [Shard(0)])])
        assert torch.equal(buffer.to_local(), fresh)
        with pytest.raises(RuntimeError, match="'attn.qkv'.*Replicate"):
            copy_grads(opt, [buffer], [distribute_tensor(fresh, mesh, [Replicate()])])
    finally:
        dist.destroy_process_group()
