"""The kernels' side of the guard and of padding, against float64 math and the PyTorch
references: on CPU under TRITON_INTERPRET=1 (in a subprocess, since the variable must be set
before Triton is imported), on GPU directly.

- the momentum pass leaves an entry whose gradient is not finite as it was and makes its row
  measure NaN (scores and squares);
- the snapshot skips error feedback on rows whose factor is not finite, and writes U into the
  matrices of a padded buffer, leaving the padding zero;
- restoring a skipped matrix undoes the accumulation and the error feedback (the unselected
  rows' decay too), and leaves the others alone;
- the post-update with the guard's verdict updates only the kept matrices and, in the same
  launch, puts the skipped ones' momentum back (Muon, Dion3; gradients in one tensor or in
  pieces), and leaves a layout it cannot restore to its caller;
- the post-update reads an update that is a padded buffer's (strided) matrices, and the
  scale-and-cast writes into one."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys, torch
    mk, pk, sk, reference = (importlib.import_module(f"dion3.kernels.{name}")  # the modules, not the dispatch
                             for name in ("momentum", "post_update", "scale", "reference"))
    device = sys.argv[1]
    gen = torch.Generator().manual_seed(0)
    out = {}

    def rel(a, b):
        a, b = a.double().cpu(), b.double().cpu()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    # the momentum pass with a NaN and an inf gradient entry
    m0 = torch.randn(3, 6, 40, generator=gen)
    g = torch.randn(3, 6, 40, generator=gen)
    g[1, 2, 5], g[2, 0, 7] = float("nan"), float("inf")
    for name, decay in (("muon", 0.9), ("dion3", 1.0)):
        m = m0.to(device).clone()
        scores, squares = mk.accumulate_momentum_triton(m, [g[:1].to(device), g[1:].to(device)], decay, True, True)
        finite = torch.isfinite(g)
        want = torch.where(finite, decay * m0.double() + g.double(), m0.double())
        out[f"{name}_kept_bitwise"] = bool(torch.equal(m.cpu()[~finite], m0[~finite]))
        out[f"{name}_error"] = rel(torch.where(finite, m.cpu(), 0), torch.where(finite, want, 0))
        bad_rows = (~finite).any(-1)
        out[f"{name}_nan_rows"] = bool(torch.equal(scores.cpu().isnan(), bad_rows)) and bool(
            torch.equal(squares.cpu().isnan(), bad_rows))
        # the same rule in the PyTorch reference
        r = m0.clone()
        rs, rq = reference.accumulate_momentum_reference(r, [g[:1], g[1:]], decay, True, True)
        out[f"{name}_reference_agrees"] = rel(r, m.cpu()) <= 1e-6 and bool(torch.equal(rs.isnan(), bad_rows))

    # the snapshot: factor NaN for matrix 1 (no error feedback there), U into a padded buffer
    m0 = torch.randn(3, 9, 37, generator=gen)
    rows = torch.stack([torch.randperm(9, generator=gen)[:5].sort().values for _ in range(3)])
    factor = torch.tensor([0.5, float("nan"), 2.0]).view(3, 1, 1)
    buffer = torch.full((3, 8, 40), 7.0, dtype=torch.bfloat16, device=device)
    buffer[:, 5:].zero_(); buffer[:, :5, 37:].zero_()
    m = m0.to(device).clone()
    mk.snapshot_rows_triton(m, rows.to(device), 0.8, factor.to(device), torch.bfloat16, out=buffer[:, :5, :37])
    picked = m0.gather(1, rows.unsqueeze(-1).expand(3, 5, 37))
    want_u = picked * factor
    out["snapshot_u"] = rel(buffer[[0, 2], :5, :37].float(), want_u[[0, 2]])
    out["snapshot_padding_zero"] = bool((buffer[:, 5:] == 0).all()) and bool((buffer[:, :5, 37:] == 0).all())
    fed = m0.clone(); fed[[0, 2]] = fed[[0, 2]].scatter(1, rows[[0, 2]].unsqueeze(-1).expand(2, 5, 37), picked[[0, 2]] * 0.8)
    out["snapshot_feedback"] = rel(m.cpu(), fed)
    out["snapshot_skipped_matrix_bitwise"] = bool(torch.equal(m.cpu()[1], m0[1]))

    # restore: Dion3 (decay 1, error feedback 0.6 on the selected rows; with unselected_decay 0.75,
    # 0.75 on the others) on matrices 0 and 2
    m0 = torch.randn(3, 8, 24, generator=gen)
    g = torch.randn(3, 8, 24, generator=gen)
    g[2, 1, 3] = float("nan")
    rows = torch.stack([torch.randperm(8, generator=gen)[:3].sort().values for _ in range(3)])
    selected = torch.zeros(3, 8, dtype=torch.bool).scatter(1, rows, True)
    positions = torch.where(selected, 0, -1).to(torch.int32)
    fed = torch.tensor([True, True, False])  # matrix 2's gradient was not finite: no error feedback
    norms = torch.tensor([1.5, 2.0, float("nan")])  # the snapshot's norms: NaN where it skipped feedback
    keep = torch.tensor([False, True, False])
    for impl in ("kernel", "reference"):
        for unselected, name in ((1.0, f"restore_{impl}"), (0.75, f"restore_{impl}_unselected")):
            m = m0.to(device).clone()
            mk.accumulate_momentum_triton(m, [g.to(device)], 1.0, True, True)
            stepped = m.clone()
            feedback = torch.where(fed[:, None], torch.where(selected, 0.6, unselected), 1.0).unsqueeze(-1).to(device)
            m.mul_(feedback)
            args = (m, [g.to(device)], keep.to(device), 1.0, 0.6, norms.to(device), positions.to(device), unselected)
            (mk.restore_momentum_triton if impl == "kernel" else reference.restore_momentum_reference)(*args)
            out[f"{name}_error"] = rel(m.cpu()[[0, 2]], m0[[0, 2]])
            out[f"{name}_kept_bitwise"] = bool(torch.equal(m.cpu()[1], (stepped * feedback)[1].cpu()))
            out[f"{name}_nan_entry_bitwise"] = bool(m.cpu()[2, 1, 3] == m0[2, 1, 3])

    # the post-update with the verdict, restoring the skipped matrices' momentum in the same launch:
    # Muon (decay 0.7, gradients in one tensor, then in two pieces: a pointer table) and Dion3 (decay
    # 1, rows, per-row factors, error feedback 0.6 on the selected rows and unselected_decay 0.75 on
    # the others undone where the snapshot's norm was finite)
    keep = torch.tensor([True, False, True, False])
    m0 = torch.randn(4, 8, 24, generator=gen)
    g = torch.randn(4, 8, 24, generator=gen)
    g[3, 2, 5] = float("inf")
    p0 = torch.randn(4, 8, 24, generator=gen)
    o = torch.randn(4, 8, 24, generator=gen)
    o[1, 0, 0] = float("nan")  # a skipped matrix's update: never reaches its weights
    for name, pieces in (("muon_one", [g]), ("muon_pieces", [g[:2], g[2:]])):
        m = torch.where(torch.isfinite(g), 0.7 * m0 + g, m0).to(device)
        params = [p0.to(device).clone()]
        restore = reference.MomentumRestore(m, [piece.to(device).contiguous() for piece in pieces], 0.7)
        done = pk.post_update_triton(params, o.to(device), None, 0.9, 0.1, None, keep.to(device), restore)
        want = torch.where(keep.view(4, 1, 1), 0.9 * p0.double() - 0.1 * o.double(), 0.9 * p0.double())
        out[f"{name}_in_launch"] = done
        out[f"{name}_params"] = rel(params[0], want)
        out[f"{name}_restored"] = rel(m.cpu()[~keep], m0[~keep])
        out[f"{name}_kept_bitwise"] = bool(torch.equal(m.cpu()[keep], torch.where(torch.isfinite(g), 0.7 * m0 + g, m0)[keep]))
    rows = torch.stack([torch.randperm(8, generator=gen)[:3].sort().values for _ in range(4)])
    selected = torch.zeros(4, 8, dtype=torch.bool).scatter(1, rows, True)
    norms = torch.tensor([1.0, 2.0, 3.0, float("nan")])  # matrix 3: no error feedback (its gradient had an inf)
    feedback = torch.where(torch.isfinite(norms)[:, None], torch.where(selected, 0.6, 0.75), 1.0).unsqueeze(-1)
    stepped = torch.where(torch.isfinite(g), m0 + g, m0)
    m = (stepped * feedback).to(device)
    update = o.gather(1, rows.unsqueeze(-1).expand(4, 3, 24))
    factor = torch.rand(4, 3, generator=gen) + 0.5
    params = [p0.to(device).clone()]
    positions = torch.where(selected, 0, -1).to(torch.int32)
    restore = reference.MomentumRestore(m, [g.to(device)], 1.0, 0.6, lambda: (positions.to(device), norms.to(device)),
                                        0.75)
    done = pk.post_update_triton(params, update.to(device), rows.to(device), 0.9, 0.1, factor.to(device), keep.to(device),
                                 restore)
    change = torch.zeros(4, 8, 24, dtype=torch.float64).scatter(1, rows.unsqueeze(-1).expand(4, 3, 24),
                                                               update.double() * factor.double().unsqueeze(-1))
    want = torch.where(keep.view(4, 1, 1), 0.9 * p0.double() - 0.1 * change, 0.9 * p0.double())
    out["dion3_in_launch"] = done
    out["dion3_params"] = rel(params[0], want)
    out["dion3_restored"] = rel(m.cpu()[~keep], m0[~keep])
    out["dion3_kept_bitwise"] = bool(torch.equal(m.cpu()[keep], (stepped * feedback)[keep]))
    # a layout the launch cannot restore (pieces of two shapes): the caller is told to restore
    m = m0.to(device).clone()
    restore = reference.MomentumRestore(m, [g[:1].to(device), g[1:].to(device)], 0.7)
    params = [p0.to(device).clone()]
    out["mixed_pieces_left_to_caller"] = not pk.post_update_triton(params, o.to(device), None, 0.9, 0.1, None,
                                                                   keep.to(device), restore)
    out["mixed_pieces_momentum_untouched"] = bool(torch.equal(m.cpu(), m0))

    # the post-update reading a padded buffer's matrices; scale-and-cast writing into one
    params = [torch.randn(2, 6, 20, generator=gen).to(device).clone()]
    before = params[0].clone()
    padded = torch.randn(2, 8, 24, generator=gen).to(device)
    update = padded[:, :6, :20]
    pk.post_update_triton(params, update, None, 0.9, 0.1, None)
    out["post_update_strided"] = rel(params[0], 0.9 * before - 0.1 * update)
    x = torch.randn(2, 5, 30, generator=gen).to(device)
    target = torch.zeros(2, 8, 32, dtype=torch.float16, device=device)
    sk.scale_cast_triton(x, torch.tensor([2.0, 3.0], device=device).view(2, 1, 1), torch.float16, target[:, :5, :30])
    out["scale_cast_into"] = rel(target[:, :5, :30].float(), x * torch.tensor([2.0, 3.0], device=device).view(2, 1, 1))
    out["scale_cast_padding_zero"] = bool((target[:, 5:] == 0).all()) and bool((target[:, :5, 30:] == 0).all())
    print(json.dumps(out))
    """
)


def _run(device: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, device], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(got: dict) -> None:
    for name in ("muon", "dion3"):
        assert got[f"{name}_kept_bitwise"] and got[f"{name}_nan_rows"] and got[f"{name}_reference_agrees"]
        assert got[f"{name}_error"] <= 1e-6
    assert got["snapshot_u"] <= 1e-2  # bf16 output
    assert got["snapshot_padding_zero"] and got["snapshot_skipped_matrix_bitwise"]
    assert got["snapshot_feedback"] <= 1e-6
    for name in ("restore_kernel", "restore_reference", "restore_kernel_unselected", "restore_reference_unselected"):
        assert got[f"{name}_error"] <= 1e-6
        assert got[f"{name}_kept_bitwise"] and got[f"{name}_nan_entry_bitwise"]
    for name in ("muon_one", "muon_pieces", "dion3"):
        assert got[f"{name}_in_launch"] and got[f"{name}_kept_bitwise"]
        assert got[f"{name}_params"] <= 1e-6 and got[f"{name}_restored"] <= 1e-6
    assert got["mixed_pieces_left_to_caller"] and got["mixed_pieces_momentum_untouched"]
    assert got["post_update_strided"] <= 1e-6
    assert got["scale_cast_into"] <= 1e-3 and got["scale_cast_padding_zero"]


def test_interpreted_guard_and_padding_kernels():
    pytest.importorskip("triton")
    _check(_run("cpu", dict(os.environ, TRITON_INTERPRET="1")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_guard_and_padding_kernels():
    _check(_run("cuda", dict(os.environ)))
