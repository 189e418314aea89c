"""Distributed step for DDP (ProcessGroup) and FSDP2 (1-D DeviceMesh, DTensor Shard(0))."""
from .exchange import Traffic
from .mesh import MeshInfo, all_ranks_true, local_row_span, local_tensor, resolve_mesh
from .plan import ShardedBucket, build_buckets, owned_matrices
from .step import run_step

__all__ = [
    "MeshInfo", "ShardedBucket", "all_ranks_true", "local_tensor", "Traffic", "build_buckets", "local_row_span", "owned_matrices",
    "resolve_mesh", "run_step",
]
