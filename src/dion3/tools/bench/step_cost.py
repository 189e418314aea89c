"""Cost model of one optimizer step: matmul FLOPs, elementwise memory traffic, bytes sent.

FLOPs count only the matrix products of orthogonalization (2·n·k·m per n×k by k×m product,
per matrix by dion3.ortho.cost); the elementwise work is memory-bound and counted as bytes
instead. Two FLOP figures:
  dense     what the algorithm costs with ordinary GEMMs (used for "effective TFLOP/s");
  executed  what runs when symmetric products compute only their lower-triangle tiles:
            T(T+1)/2 of T² tiles, T = ⌈n / tile⌉ (DESIGN §4), for the n at which the
            kernels are used (dion3.kernels sends n < SYMMETRIC_MIN_N to cuBLAS).

Bytes are the minimum traffic of a fully fused implementation, per matrix element, with fp32
parameters, gradients and state and half-precision orthogonalization input/output:
  AdamW    read p, g, m, v; write p, m, v                                     28 B
  Muon     momentum (read M, G; write M) 12 + normalize-and-cast (read M; write half) 6
           + apply (read O half; read, write X) 10                            28 B
  NorMuon  Muon + one read of O for the row norms                             30 B
  Dion3    momentum and row scores 12 + decay of all of X (read, write) 8, and per selected
           element: read M[S] 4, write U half 2, write μ·M[S] 4, read O twice 4   20 + 14·k/rows B
The floor on a device is executed_flops / matmul peak + bytes / copy bandwidth: the passes
run one after another, each bound by one resource. Small matrices do not reach the peak, so
the floor is a target, not a prediction.

Bytes sent are per rank per step for distributed runs (0 on one GPU), with `wire_bytes` per
element (fp32 snapshot by default):
  fsdp  rows sharded over W ranks; each matrix's local rows (all of them, or Dion3's local
        top ⌈f·⌈rows/W⌉⌉) travel to the rank that orthogonalizes it and come back:
        2 · count · (W−1)/W · local_rows · cols · wire_bytes
        (global selection adds an all-gather of the local row scores, 4 B each)
  ddp   replicated; each rank orthogonalizes ⌈count/W⌉ matrices and all-gathers the result
        (k rows each): (W−1) · ⌈count/W⌉ · k · cols · wire_bytes
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ...ortho.cost import (  # noqa: F401 (the per-matrix model, re-exported for callers of this module)
    H200_MATMUL_FLOPS, SYMMETRIC_TILE, MatrixShape, Symmetric, gram_products, h200_symmetric, newton_schulz_products,
    orthogonalize_flops, symmetric_share,
)
from ...rules import selected_row_count
from .presets import PRESETS, Preset

H200_COPY_BYTES_PER_S = 4.3e12  # device-to-device copy, measured
ALGORITHMS = ("adamw", "muon", "normuon", "dion3")
LAYOUTS = ("fsdp", "ddp")

@dataclass(frozen=True)
class StepCost:
    dense_flops: int
    executed_flops: float
    bytes_moved: float
    bytes_sent: float

    def floor_seconds(self, matmul_flops: float = H200_MATMUL_FLOPS, copy_bytes: float = H200_COPY_BYTES_PER_S) -> float:
        return self.executed_flops / matmul_flops + self.bytes_moved / copy_bytes


def elementwise_bytes(algorithm: str, rows: int, cols: int, selected_rows: int, momentum_bytes: int = 4) -> float:
    """Minimum fused memory traffic for one matrix (see the module docstring), with momentum of
    momentum_bytes per element (4: float32; 2: bf16, where the momentum pass reads and writes,
    and Dion3's snapshot reads and decays, two bytes less each)."""
    numel = rows * cols
    saved = 2.0 * (4 - momentum_bytes) if algorithm != "adamw" else 0.0  # one read and one write of M
    if algorithm in ("adamw", "muon"):
        return (28.0 - saved) * numel
    if algorithm == "normuon":
        return (30.0 - saved) * numel
    if algorithm == "dion3":
        return (20.0 - saved) * numel + (14.0 - saved) * selected_rows * cols
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def sent_bytes(
    shape: MatrixShape, fraction: Optional[float], world_size: int, layout: str = "fsdp",
    scope: str = "local", wire_bytes: int = 4,
) -> float:
    """Bytes one rank sends per step for one group of same-shape matrices."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be ≥ 1, got {world_size}")
    if world_size == 1:
        return 0.0
    w, count = world_size, shape.count
    if layout == "ddp":
        k = shape.rows if fraction is None else selected_row_count(shape.rows, fraction)
        return (w - 1) * math.ceil(count / w) * k * shape.cols * wire_bytes
    local_rows = math.ceil(shape.rows / w)
    k_local = local_rows if fraction is None else selected_row_count(local_rows, fraction)
    total = 2 * count * (w - 1) / w * k_local * shape.cols * wire_bytes
    if fraction is not None and scope == "global":
        total += count * (w - 1) * local_rows * 4
    return total


def step_cost(
    matrices: Sequence[MatrixShape], algorithm: str, fraction: Union[None, float, Sequence[float]] = None,
    method: str = "auto", symmetric: Symmetric = False, schedule="polar_express",
    restarts: Optional[Sequence[int]] = None, scalar_numel: int = 0,
    world_size: int = 1, layout: str = "fsdp", scope: str = "local", momentum_bytes: int = 4,
    decays_unselected: bool = False,
) -> StepCost:
    """Cost of one step over the given matrices (and `scalar_numel` AdamW elements).

    fraction (Dion3 only): one fraction for every matrix, or one per entry of `matrices`
    (per-shape fractions, e.g. from dion3.optim.cost_fractions.cost_allocated_fractions).
    decays_unselected (Dion3 only: unselected_decay < 1): the pass that reads and writes the
    momentum rows a step does not select.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if (fraction is not None) != (algorithm == "dion3"):
        raise ValueError(f"fraction is required for dion3 and meaningless for {algorithm!r}, got {fraction!r}")
    if fraction is None or isinstance(fraction, (int, float)):
        fractions = [fraction] * len(matrices)
    else:
        fractions = list(fraction)
        if len(fractions) != len(matrices):
            raise ValueError(f"fraction: {len(fractions)} per-shape fractions for {len(matrices)} matrix shapes; "
                             "give one fraction, or one per shape")
    dense = executed = 0.0
    moved, sent = 28.0 * scalar_numel, 0.0
    for shape, f in zip(matrices, fractions):
        k = shape.rows if f is None else selected_row_count(shape.rows, f)
        moved += shape.count * elementwise_bytes(algorithm, shape.rows, shape.cols, k, momentum_bytes)
        if decays_unselected and algorithm == "dion3":
            moved += shape.count * 2.0 * momentum_bytes * (shape.rows - k) * shape.cols
        if algorithm == "adamw":
            continue
        d, e = orthogonalize_flops(k, shape.cols, method, symmetric, schedule, restarts)
        dense += shape.count * d
        executed += shape.count * e
        sent += sent_bytes(shape, f, world_size, layout, scope)
    return StepCost(int(dense), executed, moved, sent)


# The variants priced: (label, algorithm, fraction, method, symmetric kernels).
TABLE_VARIANTS = (
    ("AdamW", "adamw", None, "auto", False),
    ("Muon (NS, cuBLAS)", "muon", None, "newton_schulz", False),
    ("Muon + Gram + sym", "muon", None, "auto", h200_symmetric),
    ("NorMuon + Gram + sym", "normuon", None, "auto", h200_symmetric),
    ("Dion3 f=1/2", "dion3", 0.5, "auto", h200_symmetric),
    ("Dion3 f=1/4", "dion3", 0.25, "auto", h200_symmetric),
    ("Dion3 f=1/8", "dion3", 0.125, "auto", h200_symmetric),
)


def markdown_table(preset: Preset, world_size: int = 8) -> str:
    """The cost table: FLOPs, bytes and the H200 floor for each variant on one preset."""
    lines = [
        f"| {preset.name} | dense TFLOP | executed TFLOP | GB moved | floor ms (H200) | GB sent/rank, FSDP W={world_size} |",
        "|---|---|---|---|---|---|",
    ]
    for label, algorithm, fraction, method, symmetric in TABLE_VARIANTS:
        cost = step_cost(preset.matrices, algorithm, fraction, method, symmetric, world_size=world_size)
        lines.append(
            f"| {label} | {cost.dense_flops / 1e12:.2f} | {cost.executed_flops / 1e12:.2f} | "
            f"{cost.bytes_moved / 1e9:.1f} | {cost.floor_seconds() * 1e3:.1f} | {cost.bytes_sent / 1e9:.2f} |"
        )
    return "\n".join(lines)


# the presets whose tables main prints (benchmarks/README.md, "Cost model")
TABLES = ("llama-1b", "llama-8b", "llama-70b", "llama-384", "llama-hf-110m", "llama-hf-350m", "cpu-small")


def main(argv: Optional[list[str]] = None) -> int:
    """Print the cost tables: `python -m dion3.tools.bench.step_cost`."""
    for preset in (PRESETS[name] for name in TABLES):
        print(f"{preset.name}: {preset.description}; {preset.matrix_numel / 1e9:.2f} B matrix parameters\n")
        print(markdown_table(preset) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
