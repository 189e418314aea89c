"""Direct launches of the small Triton kernels (momentum, scale, selection, normalization,
post-update, transpose).

A launch through Triton's JIT binds the arguments, computes their specialization and looks the
compiled kernel up: 77–167 µs of host time per launch on the H200 machine, where a dispatched
aten op costs ~10–30 (benchmarks/results/kernels-h200-2026-11-29.md, "Host time per launch").
The eager optimizer step at small shapes is host-bound, so a kernel that replaces a few aten ops
can make it slower. A Launcher launches each specialization through the JIT once, keeps the
compiled kernel it returns and calls that directly afterwards (CompiledKernel[grid](every
parameter in order)), which skips the JIT's work.

The key of a specialization is finer than the JIT's, so two launches with one key always run
the same compiled code: each constexpr parameter's value; each tensor's dtype and whether its
address is 16-byte aligned; each integer's width (32/64 bits, unsigned), whether it is 1 and
whether it divides by 16; floats only by type (the JIT never specializes on their value). Only
on Triton releases where the direct call was GPU-tested (TESTED_TRITON), never under
TRITON_INTERPRET; DION3_DIRECT_LAUNCH=0 turns it off.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton
from torch import Tensor

TESTED_TRITON = ((3, 6),)
_OFF = ("0", "false", "off", "no")


def _triton_version() -> tuple:
    try:
        return tuple(int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:  # a development build's version string
        return ()


def direct_launch_tested() -> bool:
    """Whether this Triton release's compiled kernels may be called directly (GPU-tested)."""
    return _triton_version() in TESTED_TRITON and os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _OFF


DIRECT_LAUNCH = direct_launch_tested() and os.environ.get("DION3_DIRECT_LAUNCH", "1").strip().lower() not in _OFF


def stop_direct_launches(error: Exception) -> None:
    """A direct launch failed in Triton's launcher (a release whose launcher expects something
    else): warn once and launch through the JIT from now on."""
    global DIRECT_LAUNCH
    DIRECT_LAUNCH = False
    warnings.warn(f"dion3: a direct launch of a Triton kernel failed ({type(error).__name__}: {str(error)[:200]}); "
                  "launching through Triton's JIT from now on", RuntimeWarning, stacklevel=3)


def _device() -> int:
    """The device Triton launches on (its driver asks torch for the current one)."""
    return torch.cuda.current_device()


def _int_width(value: int) -> int:
    if -2**31 <= value < 2**31:
        return 32
    return 64 if -2**63 <= value < 2**63 else 65  # 65: unsigned 64-bit


def _argument_key(value, constexpr: bool):
    if constexpr:
        return ("constexpr", value)
    if isinstance(value, Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", _int_width(value), value == 1, value % 16 == 0)
    if isinstance(value, float):
        return "float"
    return ("other", value)  # None and anything hashable the JIT treats as a constant


class Launcher:
    """kernel[grid](...) with direct launches after the first (see the module docstring).

    Call as launcher(grid, *parameters, **parameters_and_options): every kernel parameter, by
    position or name, and launch options (num_warps, num_stages, ...) by name.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None)  # JITFunction's; absent under the interpreter
        self._names = tuple(p.name for p in params) if params else ()
        self._constexpr = tuple(bool(p.is_constexpr) for p in params) if params else ()
        self._compiled: dict = {}

    def __call__(self, grid, *args, **kwargs):
        if not (DIRECT_LAUNCH and self._names):
            return self.kernel[grid](*args, **kwargs)
        values = list(args)
        for name in self._names[len(args):]:
            if name not in kwargs:
                raise TypeError(f"{getattr(self.kernel, '__name__', 'a Triton kernel')} needs its parameter {name!r}")
            values.append(kwargs.pop(name))
        try:
            key = (tuple(_argument_key(v, c) for v, c in zip(values, self._constexpr)),
                   tuple(sorted(kwargs.items())), _device())
            hash(key)
        except TypeError:  # an unhashable constant: this launch goes through the JIT
            return self.kernel[grid](*values, **kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*values, **kwargs)
            if compiled is not None and hasattr(compiled, "__getitem__"):
                self._compiled[key] = compiled
            return compiled
        try:
            # Triton's launcher checks every argument before it launches: an error here means
            # nothing ran, so the JIT launch below does not apply the kernel twice.
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*values)
        except (AttributeError, IndexError, KeyError, TypeError) as error:
            stop_direct_launches(error)
            return self.kernel[grid](*values, **kwargs)
        return compiled
