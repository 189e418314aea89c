"""Kernel dispatch: Triton kernels on CUDA when available and worth it, PyTorch otherwise."""
from __future__ import annotations

from .reference import post_update_reference, symmetric_matmul_reference


def symmetric_matmul(a, b, c=None, alpha: float = 1.0, beta: float = 0.0):
    """D = alpha·a·b + beta·c where the caller promises D is symmetric."""
    return symmetric_matmul_reference(a, b, c, alpha, beta)


def post_update(params, update, rows, decay, step) -> None:
    """For each [B_i, R, C] param: param ← decay·param; param[rows] −= step·update (one rounding)."""
    post_update_reference(params, update, rows, decay, step)


def symmetric_kernels_available(device) -> bool:
    """Whether symmetric products on this device run on a kernel that skips the upper triangle."""
    return False


__all__ = ["symmetric_matmul", "post_update", "symmetric_kernels_available"]
