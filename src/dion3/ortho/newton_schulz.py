"""Standard and Gram Newton–Schulz orthogonalization on batched [B, rows, cols] inputs.

Both return an approximation of the polar factor U·Vᵀ of X = U·Σ·Vᵀ. Inputs are normalized
first and processed in the wide orientation (rows ≤ cols); tall inputs are transposed. The
iterations run on a zero-padded buffer where the shape is not aligned for the kernels
(ortho.padding): exact, and at the speed of the aligned size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..kernels import contiguous_cast, copy_into, gram_with_copy, scale_cast, symmetric_matmul, symmetric_speedup
from .coefficients import CoefficientSpec, Schedule, get_schedule
from .padding import Padded, empty_padded, padded_shape
from .precision import cpu_compute_dtype, cpu_standard_speedup
from .restarts import default_restarts

METHODS = ("auto", "newton_schulz", "gram")
_NORM_EPS = 1e-7


def choose_method(rows: int, cols: int, symmetric_speedup: float = 1.0, standard_speedup: float = 1.0) -> str:
    """Standard or Gram NS, whichever costs less time for an n×m input (n ≤ m, r = m/n).

    With every symmetric product running `symmetric_speedup` (s) times faster than a dense one,
    5 steps of standard NS cost 5·(2n²m/s + 2n³/s + 2n²m) and Gram NS with one restart
    4n²m/s + 28n³/s + 4n²m. `standard_speedup` (t) is how much faster standard NS's compute
    dtype multiplies than Gram NS's (1 on GPUs: bf16 and fp16; a CPU running standard NS in
    bf16 and Gram NS in float32: see cpu_standard_speedup). Gram wins when
    r·(10/(st) + 10/t − 4/s − 4) > 28/s − 10/(st): with t = 1, r > 3/(1 + s), that is 1.5 on
    dense GEMMs (DESIGN §3) and 1 with ideal symmetric kernels (s = 2); with s = 1, t = 2.2,
    r > 21.6. Square matrices always use standard NS.
    """
    n, m = min(rows, cols), max(rows, cols)
    s, t = symmetric_speedup, standard_speedup
    slope = 10 / (s * t) + 10 / t - 4 / s - 4
    if m <= n or slope <= 0:
        return "newton_schulz"
    return "gram" if m * slope > n * (28 / s - 10 / (s * t)) else "newton_schulz"


def resolve_method(x: Tensor, method: str) -> str:
    """The concrete method "auto" stands for on this input (see choose_method)."""
    return _resolve(x.shape[-2], x.shape[-1], x.device, method, x.dtype)


def _resolve(rows: int, cols: int, device: torch.device, method: str, input_dtype: torch.dtype = torch.float32) -> str:
    if method != "auto":
        return method
    if device.type == "cuda":
        return choose_method(rows, cols, symmetric_speedup(device, min(rows, cols)))
    if input_dtype == torch.float64:  # both methods compute in float64 (default_compute_dtype)
        return choose_method(rows, cols)
    return choose_method(rows, cols, 1.0, cpu_standard_speedup(min(rows, cols)))


def default_compute_dtype(device: torch.device, method: str, input_dtype: torch.dtype = torch.float32,
                          rows: Optional[int] = None) -> torch.dtype:
    """bf16 for standard NS and fp16 for Gram NS on GPU (fp16 has more mantissa and R ≤ 1).
    On CPU: float64 inputs stay float64; Gram NS runs in float32; standard NS in
    precision.cpu_compute_dtype(rows) (bf16 where this CPU's bf16 products are clearly faster
    and the Gram side has at least BF16_MIN_ROWS rows, else float32; DION3_CPU_NS_DTYPE /
    set_cpu_compute_dtype choose explicitly). rows: the shorter side of the matrices."""
    if device.type != "cuda":
        if input_dtype == torch.float64:
            return torch.float64
        return torch.float32 if method == "gram" else cpu_compute_dtype(rows)
    return torch.float16 if method == "gram" else torch.bfloat16


@dataclass(frozen=True)
class InputScaling:
    """How orthogonalize prepares a wide input x: X = x / (norm_scale·‖x‖_F + ε), written in
    dtype. A caller that copies x anyway (Dion3's snapshot of the selected rows) can write X
    directly and pass normalized=True, saving Newton–Schulz a pass over its input."""

    dtype: torch.dtype
    norm_scale: float
    eps: float = _NORM_EPS

    def factor(self, norm: Tensor) -> Tensor:
        """The factor per matrix (norm: ‖x‖_F, float32 or wider)."""
        return torch.reciprocal(norm * self.norm_scale + self.eps)


def input_scaling(
    rows: int, cols: int, device: torch.device, method: str = "auto",
    coefficients: CoefficientSpec = "polar_express", input_dtype: torch.dtype = torch.float32,
) -> InputScaling:
    """The scaling orthogonalize(x, method, coefficients) applies to a rows×cols input on this
    device (tall inputs are scaled the same way, then transposed)."""
    method = _resolve(rows, cols, torch.device(device), method, input_dtype)
    return InputScaling(default_compute_dtype(torch.device(device), method, input_dtype, min(rows, cols)),
                        get_schedule(coefficients).norm_scale)


def _normalized_wide(x: Tensor, scaling: InputScaling, norm: Optional[Tensor] = None) -> tuple[Padded, bool]:
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    if norm is None:
        norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))
    # Out of place (never the caller's tensor), computed in x's precision and written straight
    # into the compute dtype (and the padded buffer): no float32 copy of the batch, no fp16
    # overflow before scaling.
    n, m = x.shape[-2:]
    if padded_shape(n, m, x.device, scaling.dtype) == (n, m):
        return Padded(scale_cast(x, scaling.factor(norm), scaling.dtype), n, m), transposed
    wide = empty_padded(x.shape[0], n, m, scaling.dtype, x.device)
    scale_cast(x, scaling.factor(norm), scaling.dtype, wide.matrices)
    return wide, transposed


def _wide_orientation(u: Padded, transposed: bool) -> Padded:
    """u's matrices in the wide orientation, padded: u itself, or (tall) a transposed copy of
    its whole buffer (the padding transposes with it and stays zero)."""
    if not transposed:
        return u
    return Padded(contiguous_cast(u.data.mT, u.data.dtype), u.cols, u.rows)


def newton_schulz(x: Tensor, schedule: Schedule) -> Tensor:
    """Standard NS on a normalized wide batch: X ← aX + (bA + cA²)X, A = XXᵀ.

    Off CUDA in float32/float64, X ← (aI + bA + cA²)·X: a enters on the diagonal of the n×n
    polynomial and one product writes the new X (a CPU baddbmm first copies its n×m input into
    the output). Not in half precision: a ≈ 8 rounded into a bf16 diagonal loses 0.03."""
    fold_identity = x.device.type != "cuda" and x.dtype in (torch.float32, torch.float64)
    for a, b, c in schedule.steps:
        gram, spare = gram_with_copy(x)
        poly = symmetric_matmul(gram, gram, gram, alpha=c, beta=b, b_symmetric=True)
        if fold_identity:
            poly.diagonal(dim1=-2, dim2=-1).add_(a)
            x = torch.bmm(poly, x)
        elif spare is not None:  # a copy of X came with A: update it in place, no copy into a new output
            x = spare.baddbmm_(poly, x, beta=a, alpha=1.0)
        else:
            x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    return x


def gram_newton_schulz(x: Tensor, schedule: Schedule, restarts: Sequence[int], tall_result: bool = False) -> Tensor:
    """Gram NS on a normalized wide batch [B, n, m]: iterate on R = XXᵀ (n×n) and accumulate
    Q with X_T = Q·X. Each step: Z = bR + cR², Q ← QZ + aQ, P = RZ + aR, R ← ZP + aP.
    A restart after step s sets X ← QX, R ← XXᵀ, Q ← I (clears half-precision drift in R).
    tall_result: return X_Tᵀ [B, m, n], contiguous, as Xᵀ·Q (Q is symmetric): a tall input
    comes back in its own orientation without a transposed copy."""
    steps = len(schedule)
    restart_after = set(int(s) for s in restarts)
    if any(s < 1 or s >= steps for s in restart_after):
        raise ValueError(f"restart positions must lie in 1..{steps - 1} for a {steps}-step schedule, got {list(restarts)}")
    r = symmetric_matmul(x, x.mT)
    q: Optional[Tensor] = None  # None stands for the identity
    # R, Z and P are symmetric (b_symmetric: the kernels may read them as their transposes).
    for i, (a, b, c) in enumerate(schedule.steps, start=1):
        z = symmetric_matmul(r, r, r, alpha=c, beta=b, b_symmetric=True)
        carry_on = i < steps and i not in restart_after
        if carry_on:  # P and R first: they are the last readers of Z
            p = symmetric_matmul(r, z, r, alpha=1.0, beta=a, b_symmetric=True)
            r = symmetric_matmul(z, p, p, alpha=1.0, beta=a, b_symmetric=True)
        if q is None:  # Q = I·Z + a·I, built in Z's own memory (no copy)
            q = z
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = symmetric_matmul(q, z, q, alpha=1.0, beta=a, b_symmetric=True)
        if carry_on:
            continue
        if i == steps:
            break
        x = torch.bmm(q, x)  # restart
        r = symmetric_matmul(x, x.mT)
        q = None
    if q is None:
        return x.mT if tall_result else x
    return torch.bmm(x.mT, q) if tall_result else torch.bmm(q, x)


def orthogonalize_padded(
    x, method: str, coefficients: CoefficientSpec = "polar_express", restarts: Optional[Sequence[int]] = None,
    dtype: Optional[torch.dtype] = None, norm: Optional[Tensor] = None, normalized: bool = False,
) -> Padded:
    """orthogonalize's work on a batch x [B, rows, cols] (a Tensor, or with normalized=True a
    Padded buffer that Dion3's snapshot wrote): O in the compute dtype, in a contiguous padded
    buffer of x's orientation (its .matrices: a view, strided where padded). method: a concrete
    method for the matrices' shape (resolve_method), not "auto"."""
    schedule = get_schedule(coefficients)
    source = x.data if isinstance(x, Padded) else x
    rows, cols = (x.rows, x.cols) if isinstance(x, Padded) else x.shape[-2:]
    dtype = dtype or default_compute_dtype(source.device, method, source.dtype, min(rows, cols))
    transposed = rows > cols
    if normalized:
        if source.dtype != dtype:
            raise ValueError(f"normalized=True needs an input in the compute dtype {dtype}, got {source.dtype}")
        n, m = min(rows, cols), max(rows, cols)
        if isinstance(x, Padded):
            wide = _wide_orientation(x, transposed)
        elif padded_shape(n, m, x.device, dtype) == (n, m):
            wide = Padded(contiguous_cast(x.mT, dtype) if transposed else x, n, m)
        else:
            wide = empty_padded(x.shape[0], n, m, dtype, x.device)
            copy_into(wide.matrices, x.mT if transposed else x)
    else:
        wide, transposed = _normalized_wide(source, InputScaling(dtype, schedule.norm_scale), norm)
    if method == "gram":
        if restarts is None:
            restarts = default_restarts(schedule)
        out = gram_newton_schulz(wide.data, schedule, restarts, tall_result=transposed)
    else:
        out = newton_schulz(wide.data, schedule)
        # contiguous, also for tall inputs: the fused update kernel reads rows directly
        out = contiguous_cast(out.mT, out.dtype) if transposed else out
    return Padded(out, rows, cols)


def orthogonalize(
    x: Tensor,
    method: str = "auto",
    coefficients: CoefficientSpec = "polar_express",
    restarts: Optional[Sequence[int]] = None,
    dtype: Optional[torch.dtype] = None,
    out_dtype: Optional[torch.dtype] = None,
    norm: Optional[Tensor] = None,
    normalized: bool = False,
) -> Tensor:
    """Approximate polar factor of x ([..., rows, cols]), returned in x's dtype.

    method: "auto" (Gram NS for clearly non-square inputs), "newton_schulz" or "gram".
    coefficients: a name of ortho.SCHEDULES ("polar_express", "jordan", "you", "polar_express_4",
        "polar_express_3") or an explicit list of (a, b, c).
    restarts: Gram NS restart positions (steps after which to restart); None picks the
    autotuned default for the schedule (one restart).
    dtype: compute dtype; None means bf16 (NS) / fp16 (Gram) on CUDA; on CPU float32, or bf16
    for standard NS where the CPU's bf16 products are clearly faster (see ortho.precision).
    out_dtype: dtype of the result; None means x's dtype.
    norm: the Frobenius norm of each matrix of x (shape [B, 1, 1] for the flattened batch of B
    matrices) when the caller already knows it; None measures it.
    normalized: x is already divided by norm_scale·‖x‖_F + ε and in the compute dtype (see
    input_scaling); it is used as is (a tall x is copied into the wide orientation).
    Unaligned shapes run on a zero-padded copy (ortho.padding); the result is x's shape.
    """
    if method not in METHODS:
        raise ValueError(f"unknown orthogonalization method {method!r}; expected one of {METHODS}")
    if x.dim() < 2:
        raise ValueError(f"orthogonalize needs a [..., rows, cols] tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"orthogonalize needs a real floating-point tensor, got dtype {x.dtype}")
    rows, cols = x.shape[-2], x.shape[-1]
    method = resolve_method(x, method)
    lead = x.shape[:-2]
    batch = x.reshape(-1, rows, cols)
    if batch.shape[0] == 0 or rows == 0 or cols == 0:
        return torch.zeros_like(x, dtype=out_dtype or x.dtype)
    if norm is not None and norm.shape != (batch.shape[0], 1, 1):
        raise ValueError(f"norm must have shape {(batch.shape[0], 1, 1)} (one per matrix), got {tuple(norm.shape)}")
    get_schedule(coefficients)  # unknown names raise here, before any work
    out = orthogonalize_padded(batch, method, coefficients, restarts, dtype, norm, normalized)
    # Contiguous (a padded result's matrices are a strided view; the fused update kernel reads rows
    # directly). (.to(memory_format=contiguous_format) would return a strided view unchanged.)
    out = contiguous_cast(out.matrices, out_dtype or x.dtype)
    return out.reshape(*lead, rows, cols)
