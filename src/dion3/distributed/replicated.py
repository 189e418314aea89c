"""The exchange stages of a replicated bucket (DDP, or a replicated DTensor) in the one matrix step
(dion3.matrix_step): every rank holds every matrix and runs the same pre-step; each rank
orthogonalizes its 1/W of the bucket (contiguous blocks of ⌈N/W⌉, owners.owned_matrices), one
all-gather gives every rank every O, and every rank then normalizes, guards and applies the
whole bucket as one device does — the same verdicts and the same variance everywhere, with
nothing but O on the wire."""
from __future__ import annotations

from typing import Iterator

from torch import Tensor

from ..matrix_step import LocalRoute, Owned, Whole
from ..ortho.padding import padded_buffer_of
from .exchange import Traffic, gather_chunks
from .mesh import MeshInfo
from .owners import owned_matrices


class ReplicatedRoute(LocalRoute):
    """LocalRoute's stages, with the orthogonalization split over the ranks of `mesh`."""

    def __init__(self, bucket, group: dict, cfg, mesh: MeshInfo, traffic: Traffic):
        super().__init__(bucket, group, cfg)
        self.mesh, self.traffic = mesh, traffic
        self.count = 0

    def to_owner(self) -> Iterator[None]:
        pre = self.pre_step()
        self.count = count = pre.update.shape[0]
        mine = owned_matrices(count, self.mesh.world_size, self.mesh.rank)
        padded = padded_buffer_of(pre.update)  # the owned matrices of the snapshot's padded buffer
        update = pre.update[mine.start : mine.stop] if padded is None else padded.batch(mine.start, mine.stop)
        norm = None if pre.norm is None else pre.norm[mine.start : mine.stop]
        return Owned(update, norm, pre.normalized)
        yield

    def gather(self, ortho: Tensor) -> Iterator[None]:
        count = self.count
        # in O's dtype (the compute dtype, the same on every rank): no wider than it on the wire
        block = ortho.new_zeros((-(-count // self.mesh.world_size), *ortho.shape[1:]))
        block[: ortho.shape[0]] = ortho
        gathered = gather_chunks(block, self.mesh, self.traffic, "rows")
        yield
        whole = gathered.wait().reshape(-1, *ortho.shape[1:])[:count]
        return Whole(whole, self.bucket.variance, self.pre.rows)
