"""Zero padding of the matrices Newton–Schulz multiplies, so that any row count runs at the
speed of the next aligned size (DESIGN §3, "Alignment").

Half-precision products stay on the tensor cores only while their leading dimensions keep
16-byte alignment, and the Hopper symmetric kernel takes only Gram sides that are multiples of
its 128-row tiles: on an H200, 32 matrices of 4096 × 4096 stepped in 623.7 ms at k = 2675
selected rows and 30.7 ms at k = 2688. Zero rows and columns appended to a matrix are exact
for standard and Gram Newton–Schulz: X·Xᵀ gains zero rows and columns, every polynomial in it
keeps them zero, the result keeps them zero and the Frobenius norm does not change. So the
orthogonalizer works on a padded buffer and hands back a view of its matrices; the pad rows
never reach selection, normalization, the guard or the update.

When to pad is a pure function of the device, the compute dtype and explicit settings (never a
timing, so every rank of a run pads alike): on CUDA in half precision, the short side of the wide
orientation (the Gram side) goes to a multiple of SHORT_MULTIPLE, the long side to a multiple of
ALIGN_MULTIPLE; elsewhere nothing is padded (CPU products need no alignment).
set_padding(m) or DION3_PADDING=m pads every side to a multiple of m on every device (the CPU
tests use it to run the padded path), "off" pads nothing, "auto" restores the rule.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor


ENV_VAR = "DION3_PADDING"
ALIGN_MULTIPLE = 8  # 16 bytes of fp16/bf16: cuBLAS tensor-core paths and TMA descriptors
# The Gram side: the Hopper symmetric kernel's tile (hopper_tiling: blocks of 128 or 256), also
# below SYMMETRIC_MIN_N, where padding to 8 measured worse (H200, 32 matrices, eager steps,
# benchmarks/results/k-sweep-h200-2026-12-02.md: k = 1016 on 4096 columns, padded to 1016 and
# so below the symmetric kernels' 1024, stepped 1.19× slower than k = 1024; k = 260 of 1008 × 3008
# rows, padded to 264, 1.59× slower than k = 384).
SHORT_MULTIPLE = 128
_HALF = (torch.float16, torch.bfloat16)
_override: Optional[Union[int, str]] = None  # None: the environment's choice


def _parse(value: Union[int, str, None], what: str) -> Union[int, str]:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return "auto"
    if isinstance(value, str) and value.strip().lower() in ("off", "0", "1", "none"):
        return 1
    try:
        multiple = int(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        multiple = None
    if multiple is None or multiple < 1 or (isinstance(value, float) and value != multiple):
        raise ValueError(f"{what}: padding must be 'auto', 'off' or a positive integer multiple, got {value!r}")
    return multiple


def set_padding(multiple: Union[int, str, None]) -> None:
    """Pad every side of the orthogonalized matrices to a multiple of `multiple` on every device
    (1 or "off": no padding), or None / "auto" for the rule above (DION3_PADDING applies again)."""
    global _override
    _override = None if multiple is None else _parse(multiple, "set_padding(multiple)")
    if _override == "auto":
        _override = None


def _setting() -> Union[int, str]:
    if _override is not None:
        return _override
    return _parse(os.environ.get(ENV_VAR, "auto"), f"environment variable {ENV_VAR}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_shape(rows: int, cols: int, device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """(rows, cols) of the buffer that rows × cols matrices are orthogonalized in, computing in
    dtype on device (see the module docstring)."""
    setting = _setting()
    if setting != "auto":
        return _round_up(rows, setting), _round_up(cols, setting)
    if torch.device(device).type != "cuda" or dtype not in _HALF:
        return rows, cols
    if rows <= cols:
        return _round_up(rows, SHORT_MULTIPLE), _round_up(cols, ALIGN_MULTIPLE)
    return _round_up(rows, ALIGN_MULTIPLE), _round_up(cols, SHORT_MULTIPLE)


class Padded(NamedTuple):
    """Matrices [B, rows, cols] held in the top-left corner of a zero-padded buffer `data`
    [B, rows_p, cols_p] (data itself when nothing is padded)."""

    data: Tensor
    rows: int
    cols: int

    @property
    def matrices(self) -> Tensor:
        """The matrices, a view of data (strided when padded)."""
        if self.data.shape[-2:] == (self.rows, self.cols):
            return self.data
        return self.data[..., : self.rows, : self.cols]

    @property
    def is_padded(self) -> bool:
        return self.data.shape[-2:] != (self.rows, self.cols)

    def batch(self, start: int, stop: int) -> "Padded":
        """Matrices start..stop of the batch (a view)."""
        return Padded(self.data[start:stop], self.rows, self.cols)


def empty_padded(batch: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Padded:
    """A padded buffer for batch matrices of rows × cols in dtype on device: the padding is
    zero, the matrices are left for the caller to write (uninitialized)."""
    rows_p, cols_p = padded_shape(rows, cols, device, dtype)
    data = torch.empty((batch, rows_p, cols_p), dtype=dtype, device=device)
    if rows_p != rows:
        data[:, rows:].zero_()
    if cols_p != cols:
        data[:, :rows, cols:].zero_()
    return Padded(data, rows, cols)


def padded_copy(x: Tensor) -> Padded:
    """x [B, rows, cols] in the padded layout for its device and dtype: x itself when no side
    needs padding, else a padded copy (one pass over x)."""
    rows, cols = x.shape[-2:]
    if padded_shape(rows, cols, x.device, x.dtype) == (rows, cols):
        return Padded(x, rows, cols)
    out = empty_padded(x.shape[0], rows, cols, x.dtype, x.device)
    out.matrices.copy_(x)
    return out


_MARK = "_dion3_padded"


def marked_matrices(padded: Padded) -> Tensor:
    """padded's matrices as a Tensor that remembers its buffer (padded_buffer_of finds it), so
    code that passes the matrices along can hand Newton–Schulz the padded buffer, not a copy."""
    matrices = padded.matrices
    if padded.is_padded:
        setattr(matrices, _MARK, padded)
    return matrices


def padded_buffer_of(x: Tensor) -> Optional[Padded]:
    """The padded buffer whose matrices x is (marked_matrices), or None: set only by this
    package on the views it made (a view of x, a slice for instance, carries no mark)."""
    padded = getattr(x, _MARK, None)
    if padded is None or padded.data.data_ptr() != x.data_ptr() or tuple(x.shape) != (
            padded.data.shape[0], padded.rows, padded.cols):
        return None
    return padded
