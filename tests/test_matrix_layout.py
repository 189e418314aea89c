"""matrix_layout: the global rows/columns/experts a mesh coordinate holds, against torch.chunk on
index tensors applied in mesh-axis order (the rule that tests/test_distributed_layouts.py checks
against real DTensors on gloo), for uneven splits, more parts than rows, and strided row
sharding inside TP blocks. matrix_layout splits Python ranges; this reference splits tensors."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dion3.distributed.layout import matrix_layout


def _chunk(indices: torch.Tensor, parts: int, part: int) -> list[int]:
    pieces = indices.chunk(parts)
    return pieces[part].tolist() if part < len(pieces) else []


def _reference(n: int, placements, mesh_shape, coordinate, dim: int) -> list[int]:
    indices = torch.arange(n)
    for axis, placement in enumerate(placements):
        if not isinstance(placement, (Shard, _StridedShard)) or placement.dim != dim:
            continue
        parts, part = mesh_shape[axis], coordinate[axis]
        if isinstance(placement, _StridedShard):
            blocks = indices.chunk(placement.split_factor)
            indices = torch.tensor([i for b in blocks for i in _chunk(b, parts, part)], dtype=torch.long)
        else:
            indices = torch.tensor(_chunk(indices, parts, part), dtype=torch.long)
    return indices.tolist()


CASES = [
    ((10, 6), (Shard(0),), (4,)),
    ((3, 5), (Shard(0),), (8,)),  # more parts than rows: the last parts hold none
    ((10, 7), (Shard(1),), (3,)),
    ((12, 6), (_StridedShard(0, split_factor=2), Shard(0)), (2, 2)),
    ((13, 6), (_StridedShard(0, split_factor=3), Shard(0)), (2, 3)),
    ((9, 8), (Shard(0), Shard(1)), (2, 2)),
    ((8, 4), (Replicate(), Shard(0)), (2, 4)),
]


@pytest.mark.parametrize("shape, placements, mesh_shape", CASES)
def test_matrix_layout_matches_torch_chunk(shape, placements, mesh_shape):
    for coordinate in itertools.product(*[range(n) for n in mesh_shape]):
        layout = matrix_layout(shape, placements, mesh_shape, coordinate, flatten=False)
        rows = _reference(shape[0], placements, mesh_shape, coordinate, 0)
        cols = _reference(shape[1], placements, mesh_shape, coordinate, 1)
        assert layout.rows == tuple(rows) and isinstance(layout.rows, tuple)
        assert layout.cols == ((cols[0], cols[-1] + 1) if cols else (0, 0))
        assert layout.batch == (0,)


def test_expert_stack_batch_sharding():
    shape, placements, mesh_shape = (6, 4, 3), (Shard(0),), (4,)
    for part in range(4):
        layout = matrix_layout(shape, placements, mesh_shape, (part,), flatten=False)
        assert layout.batch == tuple(_reference(6, placements, mesh_shape, (part,), 0))
        assert layout.rows == tuple(range(4)) and layout.cols == (0, 3)
