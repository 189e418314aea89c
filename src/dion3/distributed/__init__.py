"""Distributed step for DDP (ProcessGroup), FSDP2 and every DTensor layout of large-model
training (TP columns, strided rows, HSDP, expert stacks), each bucket over its own mesh axes.

Modules import downwards only: mesh → layout → owners → bucket → state → bucketing (the planner);
exchange → selection → replicated, sharded (the routes of dion3.matrix_step) → interleave (the step)."""
from .bucket import LayoutBucket, ShardedBucket
from .exchange import Traffic
from .layout import MatrixLayout, classify, matrix_layout
from .mesh import (
    MeshInfo, agree_on_pieces, all_ranks_true, axes_group, is_dtensor, local_row_span, local_tensor, resolve_mesh,
    settled,
)
from .owners import owned_matrices
from .bucketing import build_buckets
from .interleave import run_step

__all__ = [
    "LayoutBucket", "MatrixLayout", "MeshInfo", "ShardedBucket", "Traffic", "agree_on_pieces", "all_ranks_true", "axes_group",
    "build_buckets", "classify", "is_dtensor", "local_row_span", "local_tensor", "matrix_layout", "owned_matrices",
    "resolve_mesh", "run_step", "settled",
]
