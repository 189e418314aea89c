"""CapturedStep on per-block groups (num_heads, split_sizes) of sharded layouts, on gloo, with
the CPU stand-ins for capture of tests/graph_standin.py (every replay runs inside
captured_region: no host sync, the same collectives and split sizes as at capture). Run inside
the spawned processes of tests/sharded_blocks_worker.py (no processes of its own: starting
them costs more than these steps); checked by tests/test_sharded_blocks.py.

Layouts: FSDP2 Shard(0) over 2 ranks (DTensors cut by distribute_tensor, as fully_shard does),
with a group of whole Shard(0) parameters beside the per-block ones (the row-sharded fast path);
torchtitan's FSDP2 + TP recipe on (dp=2, tp=2) (tests/layouts_worker.py). For each, Muon,
NorMuon and Dion3 "local" (whose fraction changes twice, so that more graphs are captured)
against the same optimizer stepped eagerly on the same layout (bit for bit: the stand-in runs
the same step) and against one process stepping the same fused weights with the same groups
(where the rule is the one-process rule: Muon, NorMuon, and Dion3 "local" on blocks that each
lie whole on one rank). Not a test module (no test_ prefix).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard, distribute_tensor

import gloo
from dion3 import Dion3
from dion3.distributed import LayoutBucket
from dion3.optim.graph import CapturedStep, to_device_scalars
from graph_standin import CPUCapturedStep
from layouts_worker import cut, full, grads_for, max_relative_error, recipe

SETTINGS = dict(lr=0.02, weight_decay=0.1, orthogonalizer="newton_schulz")
ALGORITHMS = {
    "muon": {"algorithm": "muon"},
    "normuon": {"algorithm": "normuon"},
    "dion3_local": {"algorithm": "dion3", "selection_scope": "local"},
}
WARMUP = 1
# Dion3: 3 calls at each fraction. 0.45 and 0.35 give the same k = ⌈f·rows⌉ of the whole 6-row
# and 2-row blocks of FSDP's split (6, 2, 2) (3 and 1), but not of the rows one rank holds of the
# first block (5 of its 6: ⌈f·5⌉ = 3, then 2): a graph per fraction there. Where a fraction gives
# the k of an earlier one, its calls replay that graph.
FRACTIONS = [0.45] * 3 + [0.35] * 3 + [0.2] * 3
PLAIN_STEPS = 3  # Muon/NorMuon: an eager step, a capture, a replay


def _sharded(mesh, shape, seed, count=2) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen), mesh, [Shard(0)],
                                                 src_data_rank=None)) for _ in range(count)]


def fsdp_groups(mesh, option: str) -> list:
    """[(params, block option)]: 12-row weights in 3 heads (head 1 straddles the ranks' 6/6 rows)
    or 10-row weights split (6, 2, 2) (the 6-row block straddles the 5/5 rows), and whole 12-row
    weights (no option: the row-sharded fast path)."""
    blocked = (_sharded(mesh, (12, 8), 1), {"num_heads": 3}) if option == "num_heads" else (
        _sharded(mesh, (10, 6), 2), {"split_sizes": (6, 2, 2)})
    return [blocked, (_sharded(mesh, (12, 8), 3), {})]


def whole_heads_groups(mesh) -> list:
    """16 rows in 4 heads over 2 ranks: every head lies whole on one rank, so "local" selection
    is the one-process selection."""
    return [(_sharded(mesh, (16, 8), 4), {"num_heads": 4})]


def recipe_groups(mesh, option: str, scale: int = 1) -> list:
    """The recipe's weights (wq/wv/wo/down 8·scale rows, up 12·scale, wk 4·scale) in heads or in
    uneven blocks."""
    model, _ = recipe(mesh, dim=8 * scale, hidden=12 * scale)
    named = {n.split(".")[0]: p for n, p in model.named_parameters()}
    square = [named[n] for n in ("wq", "wv", "wo", "down")]
    if option == "num_heads":
        return [(square, {"num_heads": 2}), ([named["up"]], {"num_heads": 3}), ([named["wk"]], {"num_heads": 2})]
    return [(square, {"split_sizes": (5 * scale, 3 * scale)}),
            ([named["up"]], {"split_sizes": (6 * scale, 4 * scale, 2 * scale)}),
            ([named["wk"]], {"split_sizes": (3 * scale, scale)})]


def _optimizer(groups, settings, fraction, single=False) -> Dion3:
    made = []
    for params, option in groups:
        made.append(dict(params=[torch.nn.Parameter(full(p)) for p in params] if single else params,
                         **option, **settings))
    return Dion3(made, fraction=fraction, **SETTINGS)


def compare(make_groups, name: str, one_process: bool) -> dict:
    """Captured (stand-in) vs eager on the same layout (largest absolute difference of weights and
    momentum, exactly 0 expected) and vs one process (relative error, or None when not asked),
    with the stand-in's log of eager steps, captures and replays."""
    settings = ALGORITHMS[name]
    fractions = FRACTIONS if settings["algorithm"] == "dion3" else [1.0] * PLAIN_STEPS
    captured_groups, eager_groups = make_groups(), make_groups()
    captured = _optimizer(captured_groups, settings, fractions[0])
    eager = _optimizer(eager_groups, settings, fractions[0])
    single = _optimizer(captured_groups, settings, fractions[0], single=True)
    to_device_scalars(eager, torch.device("cpu"))
    step = CPUCapturedStep(captured, warmup_steps=WARMUP)
    params = [p for ps, _ in captured_groups for p in ps]
    eager_params = [p for ps, _ in eager_groups for p in ps]
    single_params = [p for g in single.param_groups for p in g["params"]]
    for number, fraction in enumerate(fractions):
        for opt in (captured, eager, single):
            for group in opt.param_groups:
                group["fraction"] = fraction
        grads = grads_for([tuple(p.shape) for p in params], number)
        for p, e, s, g in zip(params, eager_params, single_params, grads):
            if number % 2 and p.grad is not None:  # odd steps: into the same gradient tensors
                p.grad.copy_(cut(g, p))
            else:  # even steps: new gradient tensors (the replay copies them into its buffers)
                p.grad = cut(g, p)
            e.grad, s.grad = cut(g, e), g.clone()
        step()
        eager.step()
        single.step()

    def gap(a, b):
        return float((full(a) - full(b)).abs().max())

    pairs = list(zip(params, eager_params))
    exact = max(max(gap(p, e) for p, e in pairs),
                max(gap(captured.state[p]["momentum"], eager.state[e]["momentum"]) for p, e in pairs))
    result = {"eager_gap": exact, "log": [kind for kind, _ in step.log], "keys": len(step.graphs)}
    # cached "local" split plans of the general-layout bucket that has the most
    result["local_plans"] = max((sum(1 for key in b.slot_cache if isinstance(key, tuple) and key[0] == "local")
                                 for buckets in captured._buckets for b in buckets if isinstance(b, LayoutBucket)),
                                default=0)
    if one_process:
        result["one_process"] = max(
            max_relative_error([full(p) for p in params], [s.detach() for s in single_params]),
            max_relative_error([full(captured.state[p]["momentum"]) for p in params],
                               [single.state[s]["momentum"] for s in single_params]))
    return result


def refusals(make_groups) -> dict:
    """CapturedStep on a distributed optimizer with a "global" Dion3/Dion2 group (group 1, after a
    Muon group): the ValueError text, or None when it was accepted."""
    messages = {}
    for name in ("dion3", "dion2"):
        def build(name=name):
            (first, option), (second, other) = make_groups()[:2]
            opt = Dion3([dict(params=first, algorithm="muon", **option),
                         dict(params=second, algorithm=name, selection_scope="global", **other)], **SETTINGS)
            CapturedStep(opt)
        messages[name] = gloo.value_errors({name: build})[name]
    return messages


def scenarios(mesh) -> dict:
    """Every scenario on `mesh`: 1-D (FSDP2 over its ranks) or (dp, tp)."""
    out = {}
    layout = "fsdp" if mesh.ndim == 1 else "dp_tp"
    builders = {"fsdp": fsdp_groups, "dp_tp": recipe_groups}
    for option in ("num_heads", "split_sizes"):
        for name in ALGORITHMS:
            out[f"{layout}/{option}/{name}"] = compare(lambda: builders[layout](mesh, option), name,
                                                       one_process=name != "dion3_local")
    if layout == "fsdp":
        out["fsdp/whole_heads/dion3_local"] = compare(lambda: whole_heads_groups(mesh), "dion3_local", True)
    out["refused"] = refusals(lambda: builders[layout](mesh, "split_sizes"))
    return out
