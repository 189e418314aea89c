"""Replay what benchmarks/nonfinite_trace.py kept: a whole optimizer step (DIR/<run>-step<N>.pt)
or one orthogonalization (DIR/<run>-<n>.pt), on the CPU or a GPU, in the recorded dtypes, in
float32 or in float64, to find the operation that produced a non-finite value.

    python benchmarks/replay_step.py DUMP.pt                       # CPU, recorded dtypes
    python benchmarks/replay_step.py DUMP.pt --device cuda --dtype float64

A step dump is replayed by building the same optimizer (class, groups and settings) on copies
of the recorded parameters, loading the recorded state and gradients and stepping once; it
prints which parameters and gradients were not finite, how many matrix updates the optimizer
skipped, and the largest ‖O‖_F/√n of each orthogonalization of the step. An orthogonalization
dump is replayed with its recorded method and arguments, next to float64 standard Newton–Schulz
on the same input.
"""
from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path
from typing import Optional

import torch

SRC = Path(__file__).resolve().parent.parent / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

import dion3  # noqa: E402
from dion3 import rules  # noqa: E402
from dion3.ortho import orthogonalize  # noqa: E402


def _ratio(out: torch.Tensor) -> float:
    n = min(out.shape[-2:])
    norms = torch.linalg.vector_norm(out.reshape(-1, *out.shape[-2:]).double(), dim=(-2, -1)) / math.sqrt(n)
    return float(torch.nan_to_num(norms, nan=math.inf).max())


def replay_step(dump: dict, device: torch.device, dtype: Optional[torch.dtype] = None) -> dict:
    """Step the recorded optimizer once on the recorded inputs; what came out."""
    def cast(t):
        return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)

    params = [torch.nn.Parameter(cast(p)) for p in dump["params"]]
    groups, start = [], 0
    for settings, size in zip(dump["groups"], dump["group_sizes"]):
        groups.append(dict(settings, params=params[start:start + size]))
        start += size
    optimizer = getattr(dion3, dump["optimizer"])(groups)
    for p, state, grad in zip(params, dump["state"], dump["grads"]):
        for key, value in state.items():
            if torch.is_tensor(value) and key in optimizer.state[p]:
                optimizer.state[p][key].copy_(cast(value))
        p.grad = None if grad is None else cast(grad)
    ratios = []
    original = rules.orthogonalize

    def watched(x, *args, **kwargs):
        out = original(x, *args, **kwargs)
        ratios.append(_ratio(out))
        return out

    rules.orthogonalize = watched
    try:
        optimizer.step()
    finally:
        rules.orthogonalize = original
    names = [f"param{i}{tuple(p.shape)}" for i, p in enumerate(params)]
    return {
        "nonfinite_grads": [n for n, g in zip(names, dump["grads"]) if g is not None and not bool(torch.isfinite(g).all())],
        "nonfinite_params": [n for n, p in zip(names, params) if not bool(torch.isfinite(p).all())],
        "skipped_updates": int(optimizer.nonfinite_updates),
        "orthogonalization_ratios": ratios,
    }


def replay_orthogonalization(dump: dict, device: torch.device, dtype: Optional[torch.dtype] = None) -> dict:
    """The recorded call again, and float64 standard Newton–Schulz on the same input."""
    x = dump["input"].to(device)
    kwargs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in dump["kwargs"].items()}
    if dtype is not None:
        kwargs["dtype"] = dtype
        if kwargs.get("normalized") and x.dtype != dtype:
            x = x.to(dtype)
    out = orthogonalize(x, dump["method"], dump["coefficients"], *dump["args"], **kwargs)
    reference = orthogonalize(x.double(), "newton_schulz", dump["coefficients"])
    finite_input = bool(torch.isfinite(x).all())
    singular = torch.linalg.svdvals(x.double().reshape(-1, *x.shape[-2:])) if finite_input else torch.full((1,), math.nan)
    return {"ratio": _ratio(out), "recorded_ratio": _ratio(dump["output"]), "reference_ratio": _ratio(reference),
            "nonfinite": not bool(torch.isfinite(out).all()), "finite_input": finite_input,
            "input_singular_max": float(singular.max()), "input_singular_min": float(singular.min())}


def explain_orthogonalization(dump: dict, device: torch.device, repeats: int = 4, fill_nan: bool = False) -> dict:
    """Where a recorded orthogonalization goes wrong: the largest |entry| of every symmetric
    product Newton–Schulz makes (in call order: for Gram NS, R then per step Z, P, R, Q), the
    input's normalized singular values, and which matrices of the batch come out bad in each of
    `repeats` replays (bit-identical or not). fill_nan: new tensors start as NaN
    (torch.utils.deterministic.fill_uninitialized_memory), so an output element that no
    kernel writes shows up as NaN instead of as whatever that memory held before."""
    newton_schulz = importlib.import_module("dion3.ortho.newton_schulz")  # the module (the package exports a function of that name)
    x = dump["input"].to(device)
    kwargs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in dump["kwargs"].items()}
    products = []
    original = newton_schulz.symmetric_matmul

    def watched(*args, **kw):
        out = original(*args, **kw)
        products.append(float(torch.nan_to_num(out.float().abs(), nan=math.inf).max()))
        return out

    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    newton_schulz.symmetric_matmul = watched
    try:
        if fill_nan:
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = True
        outputs = [orthogonalize(x, dump["method"], dump["coefficients"], *dump["args"], **kwargs) for _ in range(repeats)]
    finally:
        newton_schulz.symmetric_matmul = original
        torch.use_deterministic_algorithms(was_deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling
    per_call = len(products) // repeats
    wide = x.double().reshape(-1, *x.shape[-2:])
    singular = torch.linalg.svdvals(wide[:1]) if bool(torch.isfinite(wide[0]).all()) else torch.full((1, 1), math.nan)
    top = singular[0, 0]

    def bad_matrices(out: torch.Tensor) -> list:
        n = min(out.shape[-2:])
        ratios = torch.linalg.vector_norm(out.reshape(-1, *out.shape[-2:]).double(), dim=(-2, -1)) / math.sqrt(n)
        return [i for i, r in enumerate(torch.nan_to_num(ratios, nan=math.inf).tolist()) if not r <= 1.5]

    return {
        "product_max_abs": products[:per_call],
        "replays_identical": all(torch.equal(outputs[0], o) for o in outputs[1:]),
        "replays_bad_matrices": [bad_matrices(o) for o in outputs],
        "recorded_bad_matrices": bad_matrices(dump["output"]),
        "singular_top5": singular[0, :5].tolist(),
        "singular_below_1e-3_of_top": int((singular[0] < 1e-3 * top).sum()),
        "singular_count": singular.shape[-1],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "float64"], help="replay in this dtype (default: as recorded)")
    parser.add_argument("--explain", action="store_true",
                        help="orthogonalization dumps: the size of every product, the input's spectrum, replay determinism")
    parser.add_argument("--repeats", type=int, default=4, help="--explain: replays of the call (default 4)")
    parser.add_argument("--fill-nan", action="store_true",
                        help="--explain: new tensors start as NaN, so output no kernel writes shows as NaN")
    args = parser.parse_args(argv)
    dump = torch.load(args.dump, map_location="cpu", weights_only=False)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.explain:
        if "grads" in dump:
            parser.error("--explain takes an orthogonalization dump (DIR/<run>-<n>.pt), not a step dump")
        result = explain_orthogonalization(dump, torch.device(args.device), args.repeats, args.fill_nan)
    else:
        replay = replay_step if "grads" in dump else replay_orthogonalization
        result = replay(dump, torch.device(args.device), dtype)
    for key, value in result.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
