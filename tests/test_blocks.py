"""Per-block orthogonalization (num_heads, split_sizes) and algorithm="dion2" on one device.

The independent reference for a fused weight is the same optimizer stepping separate
parameters, one per block, with the same initial values and gradients: the fused weight must
get exactly their update (selection, error feedback, orthogonalization, normalization and lr
scale per block), and its state must be theirs stacked. A float64 reference (tests/reference.py)
checks one block-split Dion3 step and Dion2 from the spec.
"""
from __future__ import annotations

import io

import pytest
import torch

from dion3 import Dion3, Muon, NorMuon
from dion3.blocks import Block, block_sizes, blocks_of, option_error, row_ranges
from dion3.optim.graph import CapturedStep, to_device_scalars
from reference import ReferenceOptimizer

ALGORITHMS = [
    ("muon", {}),
    ("muon", {"nesterov": True}),
    ("normuon", {}),
    ("dion3", {"fraction": 0.3}),  # k = ⌈0.3·block rows⌉ differs per block
    ("dion3", {"fraction": 1.0}),
    ("dion2", {"fraction": 0.3}),
]
ALGORITHM_IDS = ["muon", "muon-nesterov", "normuon", "dion3-f0.3", "dion3-f1", "dion2-f0.3"]


# ---------------------------------------------------------------- the block arithmetic


def test_block_sizes_and_row_ranges():
    assert block_sizes(12) == (12,)
    assert block_sizes(12, num_heads=1) == (12,)
    assert block_sizes(12, num_heads=3) == (4, 4, 4)
    assert block_sizes(12, split_sizes=[8, 2, 2]) == (8, 2, 2)
    assert row_ranges((8, 2, 2)) == [(0, 8), (8, 10), (10, 12)]
    with pytest.raises(ValueError, match="num_heads=5 does not split"):
        block_sizes(12, num_heads=5)
    with pytest.raises(ValueError, match="sum to 11"):
        block_sizes(12, split_sizes=(8, 2, 1))


@pytest.mark.parametrize("num_heads, split_sizes, fragment", [
    (2, (1, 1), "both set"),
    (0, None, "positive integer"),
    (True, None, "positive integer"),
    (2.0, None, "positive integer"),
    (None, (), "non-empty sequence"),
    (None, "qkv", "non-empty sequence"),
    (None, 4, "non-empty sequence"),
    (None, (4, 0), "positive integers"),
    (None, (4, 2.5), "positive integers"),
])
def test_option_errors(num_heads, split_sizes, fragment):
    assert fragment in option_error(num_heads, split_sizes)


def test_option_error_accepts_valid_settings():
    assert option_error(None, None) is None
    assert option_error(4, None) is None
    assert option_error(None, [8, 2, 2]) is None


def test_blocks_are_views_and_equal_heads_fold_into_the_batch():
    x = torch.arange(2 * 6 * 3.0).view(2, 6, 3)
    (heads,) = blocks_of(x, (2, 2, 2))
    assert heads == Block(0, 6, 3)
    folded = heads.cut(x)
    assert folded.shape == (6, 2, 3) and folded.data_ptr() == x.data_ptr()
    assert torch.equal(folded[4], x[1, 2:4])  # matrix 1, head 1
    uneven = blocks_of(x, (4, 1, 1))
    assert uneven == [Block(0, 4), Block(4, 5), Block(5, 6)]
    assert all(b.cut(x).untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for b in uneven)
    assert torch.equal(uneven[1].cut(x), x[:, 4:5])


def test_heads_that_do_not_fold_become_one_block_per_head():
    x = torch.randn(6, 2, 3).transpose(0, 1)  # [2, 6, 3] whose batch stride does not fold
    before = x.clone()
    blocks = blocks_of(x, (3, 3))
    assert blocks == [Block(0, 3), Block(3, 6)]
    assert blocks[1].cut(x).shape == (2, 3, 3)
    for value, block in enumerate(blocks, start=1):
        block.cut(x).add_(value)  # views: writes reach x
    assert torch.equal(x[:, :3], before[:, :3] + 1) and torch.equal(x[:, 3:], before[:, 3:] + 2)


# ---------------------------------------------------------------- fused = separate blocks


def _make(param_groups):
    return Dion3(param_groups, lr=0.05, weight_decay=0.1)


def _split(tensor: torch.Tensor, sizes, flatten: bool) -> list[torch.Tensor]:
    """The blocks of a parameter (or gradient) as separate tensors, in block order."""
    if flatten:
        matrix = tensor.reshape(tensor.shape[0], -1)
        return [b.reshape(b.shape[0], *tensor.shape[1:]) for b in matrix.split(list(sizes), dim=0)]
    return list(tensor.split(list(sizes), dim=-2))


def _join(pieces, shape, flatten: bool) -> torch.Tensor:
    if flatten:
        return torch.cat([p.reshape(p.shape[0], -1) for p in pieces], dim=0).reshape(shape)
    return torch.cat(list(pieces), dim=-2)


def _run_fused_and_separate(shapes, sizes, option, algorithm, extra, steps=4, flatten=False, skip=None, adjust_lr="spectral_norm"):
    """Step a group of fused parameters (num_heads or split_sizes) and a group of separate
    per-block parameters with the same values and gradients; return both."""
    gen = torch.Generator().manual_seed(11)
    fused = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    separate = [[torch.nn.Parameter(b.detach().clone()) for b in _split(p.detach(), sizes, flatten)] for p in fused]
    # without flatten, a 3-D parameter is a stack of matrices
    settings = dict(algorithm=algorithm, flatten=flatten, stacked=not flatten, adjust_lr=adjust_lr, **extra)
    fused_opt = _make([dict(params=fused, **{option: option_value(option, sizes)}, **settings)])
    separate_opt = _make([dict(params=[b for blocks in separate for b in blocks], **settings)])
    for step in range(steps):
        for index, (p, blocks) in enumerate(zip(fused, separate)):
            if skip is not None and skip(step, index):
                p.grad = None
                for b in blocks:
                    b.grad = None
                continue
            g = torch.randn(p.shape, generator=gen)
            p.grad = g.clone()
            for b, gb in zip(blocks, _split(g, sizes, flatten)):
                b.grad = gb.clone()
        fused_opt.step()
        separate_opt.step()
    return fused, separate, fused_opt, separate_opt


def option_value(option, sizes):
    return len(sizes) if option == "num_heads" else tuple(sizes)


def _assert_same(fused, separate, fused_opt, separate_opt, sizes, flatten=False):
    for p, blocks in zip(fused, separate):
        assert torch.equal(p.detach(), _join([b.detach() for b in blocks], p.shape, flatten))
        state = fused_opt.state[p]
        assert set(state) == set(separate_opt.state[blocks[0]])
        for key, value in state.items():
            assert tuple(value.shape) == (tuple(p.shape) if key == "momentum" else value.shape)
            pieces = [separate_opt.state[b][key] for b in blocks]
            if key == "momentum":
                assert torch.equal(value, _join(pieces, p.shape, flatten)), key
            else:  # per-row variance: rows of the flattened matrix, or of each matrix
                assert torch.equal(value, torch.cat(pieces, dim=0 if flatten else -2)), key


@pytest.mark.parametrize("algorithm, extra", ALGORITHMS, ids=ALGORITHM_IDS)
@pytest.mark.parametrize("option, sizes", [("num_heads", (4, 4, 4)), ("split_sizes", (6, 3, 3)),
                                           ("split_sizes", (4, 4, 4))])
def test_fused_2d_equals_separate_blocks(algorithm, extra, option, sizes):
    shapes = [(12, 8), (12, 20), (12, 8)]  # wide and tall blocks; repeated shapes share buckets
    result = _run_fused_and_separate(shapes, sizes, option, algorithm, extra)
    _assert_same(*result, sizes)


@pytest.mark.parametrize("algorithm, extra", ALGORITHMS, ids=ALGORITHM_IDS)
@pytest.mark.parametrize("option, sizes", [("num_heads", (3, 3)), ("split_sizes", (4, 2))])
def test_fused_3d_batches_split_every_matrix(algorithm, extra, option, sizes):
    result = _run_fused_and_separate([(3, 6, 10), (2, 6, 5)], sizes, option, algorithm, extra)
    _assert_same(*result, sizes)


@pytest.mark.parametrize("algorithm, extra", ALGORITHMS[2:4], ids=ALGORITHM_IDS[2:4])
def test_flatten_splits_the_rows_of_the_flattened_matrix(algorithm, extra):
    sizes = (4, 2, 2)
    result = _run_fused_and_separate([(8, 3, 2, 2)], sizes, "split_sizes", algorithm, extra, flatten=True)
    _assert_same(*result, sizes, flatten=True)


@pytest.mark.parametrize("adjust_lr", ["rms_norm", None])
def test_lr_scale_follows_the_block_shape(adjust_lr):
    result = _run_fused_and_separate([(12, 8)], (8, 2, 2), "split_sizes", "normuon", {}, adjust_lr=adjust_lr)
    _assert_same(*result, (8, 2, 2))


@pytest.mark.parametrize("option, sizes", [("num_heads", (4, 4, 4)), ("split_sizes", (6, 3, 3))])
def test_parameters_without_gradients_keep_their_state(option, sizes):
    """Parameter 1 has no gradient on even steps: its blocks skip those steps, as separate
    parameters without gradients do, and everything else still matches."""
    result = _run_fused_and_separate([(12, 8), (12, 8)], sizes, option, "dion3", {"fraction": 0.3}, steps=5,
                                     skip=lambda step, index: index == 1 and step % 2 == 0)
    _assert_same(*result, sizes)


def test_heads_that_do_not_fold_share_a_bucket_with_folded_ones():
    """A 3-D parameter whose strides do not fold its heads into the batch steps head by head
    (state in parameter-shaped pieces) in the same bucket as a contiguous one: both exact."""
    gen = torch.Generator().manual_seed(5)
    strided = torch.nn.Parameter(torch.randn(6, 2, 4, generator=gen).transpose(0, 1))  # [2, 6, 4]
    plain = torch.nn.Parameter(torch.randn(2, 6, 4, generator=gen))
    fused = [strided, plain]
    separate = [[torch.nn.Parameter(b.detach().clone()) for b in p.detach().split(3, dim=-2)] for p in fused]
    fused_opt = Dion3([dict(params=fused, num_heads=2)], fraction=0.5, lr=0.05, stacked=True)
    separate_opt = Dion3([dict(params=[b for blocks in separate for b in blocks])], fraction=0.5, lr=0.05, stacked=True)
    assert len(fused_opt._buckets[0]) == 1 and fused_opt._buckets[0][0].pieces is not None
    for _ in range(3):
        for p, blocks in zip(fused, separate):
            g = torch.randn(p.shape, generator=gen)
            p.grad = g
            for b, gb in zip(blocks, g.split(3, dim=-2)):
                b.grad = gb.clone()
        fused_opt.step()
        separate_opt.step()
    _assert_same(fused, separate, fused_opt, separate_opt, (3, 3))


def test_equal_heads_keep_state_in_the_bucket_buffer():
    """num_heads (and equal split_sizes) need no copies: the state entry of a fused parameter is
    a view of its bucket's stacked buffer; uneven blocks own parameter-shaped state instead."""
    heads = torch.nn.Parameter(torch.randn(12, 8))
    opt = Muon([dict(params=[heads], num_heads=3)])
    (bucket,) = opt._buckets[0]
    assert bucket.shape == (4, 8) and bucket.pieces is None
    assert opt.state[heads]["momentum"].data_ptr() == bucket.momentum.data_ptr()
    uneven = torch.nn.Parameter(torch.randn(12, 8))
    opt = Muon([dict(params=[uneven], split_sizes=(6, 3, 3))])
    assert sorted(b.shape for b in opt._buckets[0]) == [(3, 8), (6, 8)]
    assert all(b.pieces is not None and b.momentum is None for b in opt._buckets[0])
    assert opt.state[uneven]["momentum"].shape == (12, 8)


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("option, value", [("num_heads", 3), ("split_sizes", (6, 3, 3))])
def test_state_dict_round_trip_of_a_per_block_group(option, value):
    """State for every parameter from construction on, of the parameter's shape; a resumed
    optimizer continues exactly on the unbroken run's trajectory."""
    gen = torch.Generator().manual_seed(3)
    initial = [torch.randn(12, 8, generator=gen), torch.randn(2, 12, 5, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) for t in initial] for _ in range(5)]

    def build(params):
        return Dion3([dict(params=params, **{option: value}), dict(params=[bias], algorithm="adamw")], fraction=0.3,
                     stacked=True)

    bias = torch.nn.Parameter(torch.zeros(3))
    unbroken = [torch.nn.Parameter(t.clone()) for t in initial]
    resumed = [torch.nn.Parameter(t.clone()) for t in initial]
    first, second = build(unbroken), build(resumed)
    for p in resumed:
        assert second.state[p]["momentum"].shape == p.shape and not second.state[p]["momentum"].any()
        assert second.state[p]["variance"].shape == (*p.shape[:-1], 1)
    for step, step_grads in enumerate(grads):
        if step == 3:
            buffer = io.BytesIO()
            torch.save(second.state_dict(), buffer)
            second = build(resumed)
            second.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
            for a, b in zip(unbroken, resumed):
                for key in ("momentum", "variance"):
                    assert torch.equal(first.state[a][key], second.state[b][key])
        for params, opt in ((unbroken, first), (resumed, second)):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(unbroken, resumed):
        assert torch.equal(a, b)
    saved = second.state_dict()
    assert saved["param_groups"][0][option] == value


def test_checkpoint_without_block_settings_keeps_the_groups_split():
    """A state dict whose groups do not mention num_heads/split_sizes (saved before they existed)
    loads into a per-block optimizer without dropping its split: the resumed steps still equal
    separate per-block parameters."""
    gen = torch.Generator().manual_seed(6)
    fused = torch.nn.Parameter(torch.randn(12, 8, generator=gen))
    separate = [torch.nn.Parameter(b.detach().clone()) for b in fused.detach().split([6, 3, 3])]
    opt = Dion3([dict(params=[fused], split_sizes=(6, 3, 3))], fraction=0.3)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["num_heads"], group["split_sizes"]
    opt = Dion3([dict(params=[fused], split_sizes=(6, 3, 3))], fraction=0.3)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["split_sizes"] == (6, 3, 3) and opt.param_groups[0]["num_heads"] is None
    reference = Dion3([dict(params=separate)], fraction=0.3)
    for _ in range(2):
        g = torch.randn(12, 8, generator=gen)
        fused.grad = g.clone()
        for b, gb in zip(separate, g.split([6, 3, 3])):
            b.grad = gb.clone()
        opt.step()
        reference.step()
    assert torch.equal(fused.detach(), torch.cat([b.detach() for b in separate]))


# ---------------------------------------------------------------- float64 references


@pytest.mark.parametrize("algorithm", ["dion3", "dion2"])
def test_block_split_step_matches_float64_reference(exact_orthogonalizer, algorithm):
    """Dion3 (and Dion2) with f < 1 on a fused [q; k; v] weight and a 3-D batch, against the
    float64 spec applied block by block (different k per block: ⌈0.3·8⌉ = 3, ⌈0.3·2⌉ = 1)."""
    sizes = [8, 2, 2]
    gen = torch.Generator().manual_seed(9)
    params = [torch.nn.Parameter(torch.randn(12, 16, generator=gen)),
              torch.nn.Parameter(torch.randn(2, 12, 6, generator=gen))]
    hyper = dict(lr=0.05, mu=0.9, muon_beta2=0.9, weight_decay=0.1, fraction=0.3)
    opt = Dion3([dict(params=params, split_sizes=sizes, algorithm=algorithm, stacked=True)], **hyper)
    ref = ReferenceOptimizer(params, algorithm, blocks=[sizes, sizes], **hyper)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        before = [p.detach().clone() for p in params]
        opt.step()
        ref.step(grads)
        for p, x_ref, x0 in zip(params, ref.params, before):
            torch.testing.assert_close(p.detach().double(), x_ref, rtol=1e-5, atol=1e-6)
            assert not torch.equal(p.detach(), x0)
    # the reference moved exactly k rows per block and matrix
    assert [len(rows) for rows in ref.selected[0]] == [3, 1, 1]


def test_dion2_full_fraction_equals_muon_without_nesterov():
    """Dion2 at f = 1 selects every row: M ← M + G; U = M; M ← μU is Muon's M ← μM + G one step
    shifted, so the updates agree (and Dion2 stores μ·U where Muon stores U)."""
    shapes = [(8, 24), (24, 8), (3, 6, 12)]
    gen = torch.Generator().manual_seed(2)
    dion2_params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    muon_params = [torch.nn.Parameter(p.detach().clone()) for p in dion2_params]
    hyper = dict(lr=0.03, mu=0.9, weight_decay=0.05)
    dion2 = Dion3([dict(params=dion2_params, algorithm="dion2")], fraction=1.0, stacked=True, **hyper)
    muon = Muon(muon_params, nesterov=False, stacked=True, **hyper)
    for _ in range(5):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for a, b, g in zip(dion2_params, muon_params, grads):
            a.grad, b.grad = g.clone(), g.clone()
        dion2.step()
        muon.step()
        for a, b in zip(dion2_params, muon_params):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(dion2.state[a]["momentum"], 0.9 * muon.state[b]["momentum"], rtol=1e-6, atol=1e-7)
            assert set(dion2.state[a]) == {"momentum"}


def test_dion2_differs_from_dion3_by_the_normalization():
    """Shows the Dion2 checks can fail: with the same selection, Dion3 normalizes the rows."""
    gen = torch.Generator().manual_seed(4)
    start = torch.randn(16, 12, generator=gen)
    grad = torch.randn(16, 12, generator=gen)
    results = {}
    for algorithm in ("dion2", "dion3"):
        p = torch.nn.Parameter(start.clone())
        opt = Dion3([dict(params=[p], algorithm=algorithm)], fraction=0.5, lr=0.1, weight_decay=0.0)
        p.grad = grad.clone()
        opt.step()
        results[algorithm] = p.detach() - start
    moved = [set(torch.nonzero(d.abs().sum(dim=1)).flatten().tolist()) for d in results.values()]
    assert moved[0] == moved[1] and len(moved[0]) == 8  # same selected rows
    assert not torch.allclose(results["dion2"], results["dion3"], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("cls", [Muon, NorMuon, Dion3])
def test_constructors_take_block_options(cls):
    p = torch.nn.Parameter(torch.randn(12, 8))
    for options in (dict(num_heads=4), dict(split_sizes=[6, 3, 3])):
        opt = cls([p], **options)
        (group,) = opt.param_groups
        assert all(group[k] == v for k, v in options.items())
        assert sorted(b.shape for b in opt._buckets[0])[0][0] == 3
    assert cls([p]).param_groups[0]["num_heads"] is None and cls([p]).param_groups[0]["split_sizes"] is None


def test_scalar_groups_ignore_block_options():
    """The constructor's num_heads is every group's default; AdamW/Lion groups do not use it."""
    w, bias = torch.nn.Parameter(torch.randn(12, 8)), torch.nn.Parameter(torch.randn(7))
    opt = Dion3([dict(params=[w]), dict(params=[bias], algorithm="adamw")], num_heads=4)
    w.grad, bias.grad = torch.randn_like(w), torch.randn_like(bias)
    opt.step()
    assert opt.state[bias]["exp_avg"].shape == (7,)


# ---------------------------------------------------------------- CUDA-graph bookkeeping on CPU


@pytest.mark.parametrize("option, value", [("num_heads", 3), ("split_sizes", (6, 3, 3))])
def test_device_scalars_and_scheduler_on_per_block_groups(option, value):
    """The state a captured step reads (lr / weight decay as 0-d tensors that a scheduler
    updates in place) gives exactly the float-hyperparameter steps, and those equal separate
    per-block parameters with tensor hyperparameters too."""
    sizes = (4, 4, 4) if option == "num_heads" else value
    gen = torch.Generator().manual_seed(8)
    start = [torch.randn(12, 8, generator=gen), torch.randn(12, 8, generator=gen)]
    floats = [torch.nn.Parameter(t.clone()) for t in start]
    tensors = [torch.nn.Parameter(t.clone()) for t in start]
    separate = [torch.nn.Parameter(b.clone()) for t in start for b in t.split(list(sizes))]
    hyper = dict(lr=0.05, weight_decay=0.1, fraction=0.3)
    opt_float = Dion3([dict(params=floats, **{option: value})], **hyper)
    opt_tensor = Dion3([dict(params=tensors, **{option: value})], **hyper)
    opt_separate = Dion3([dict(params=separate)], **hyper)
    for opt in (opt_tensor, opt_separate):
        to_device_scalars(opt, torch.device("cpu"))
    lr_object = opt_tensor.param_groups[0]["lr"]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt_float, opt_tensor, opt_separate)]
    for _ in range(4):
        grads = [torch.randn(12, 8, generator=gen) for _ in start]
        for params in (floats, tensors):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        for p, g in zip(separate, [b for g in grads for b in g.split(list(sizes))]):
            p.grad = g.clone()
        for opt, scheduler in zip((opt_float, opt_tensor, opt_separate), schedulers):
            opt.step()
            scheduler.step()
    assert opt_tensor.param_groups[0]["lr"] is lr_object
    for a, b in zip(floats, tensors):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    joined = [torch.cat([p.detach() for p in separate[i * len(sizes):(i + 1) * len(sizes)]]) for i in range(2)]
    for a, b in zip(tensors, joined):
        assert torch.equal(a.detach(), b)


def test_replay_gradient_sync_on_a_per_block_optimizer():
    """Replays read the captured gradient buffers: a fused parameter's fresh gradient tensor is
    copied into its buffer (the blocks are cut from that buffer at capture)."""
    fused = torch.nn.Parameter(torch.randn(12, 8))
    opt = Muon([dict(params=[fused], split_sizes=(6, 3, 3))])
    fused.grad = torch.randn(12, 8)
    step = object.__new__(CapturedStep)  # its constructor needs CUDA; the sync logic does not
    step.optimizer, step._params, step._static_grads = opt, [fused], [fused.grad]
    captured = fused.grad
    fresh = torch.randn(12, 8)
    fused.grad = fresh
    step._sync_grads()
    assert torch.equal(captured, fresh) and captured is not fresh


def test_capture_refuses_distributed_global_selection_for_dion2(tmp_path):
    """Dion2 selects rows as Dion3 does: its distributed global selection syncs split sizes
    through the host too, so capture is refused up front (checked before any CUDA test)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        w = torch.nn.Parameter(torch.randn(12, 8))
        opt = Dion3([dict(params=[w], algorithm="dion2", num_heads=2)], distributed_mesh=dist.group.WORLD,
                    selection_scope="global")
        with pytest.raises(ValueError, match="selection_scope='global'"):
            CapturedStep(opt)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", ["muon", "normuon", "dion3", "dion2"])
@pytest.mark.parametrize("option, value", [("num_heads", 4), ("split_sizes", (1024, 256, 256))])
def test_captured_per_block_steps_equal_eager_on_cuda(algorithm, option, value):
    """CUDA graph capture of per-block groups (equal heads in a bucket buffer; uneven blocks
    stacked and written back inside the graph) replays the eager steps; kernel-sized blocks."""
    device = "cuda"
    gen = torch.Generator().manual_seed(12)
    shapes = [(1536, 1024), (1536, 1024), (2, 1536, 512)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    eager = [torch.nn.Parameter(t.to(device)) for t in start]
    graphed = [torch.nn.Parameter(t.to(device)) for t in start]
    settings = dict(params=None, algorithm=algorithm, stacked=True, **{option: value})
    opt_eager = Dion3([dict(settings, params=eager)], lr=0.02, fraction=0.25)
    opt_graph = Dion3([dict(settings, params=graphed)], lr=0.02, fraction=0.25)
    to_device_scalars(opt_eager, torch.device(device))
    step = CapturedStep(opt_graph, warmup_steps=2)
    for i in range(8):
        grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
        for params in (eager, graphed):
            for p, g in zip(params, grads):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        opt_eager.step()
        step()
    assert step.graph is not None
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(opt_eager.state[a]["momentum"], opt_graph.state[b]["momentum"], rtol=2e-3, atol=2e-3)
