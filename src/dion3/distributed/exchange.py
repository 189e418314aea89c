"""Collectives of the distributed step, launched asynchronously and counted in bytes.

Every function returns a `Pending` whose `wait()` yields the received tensor, so the caller can
compute on another bucket while the data is in flight. Bytes are counted per rank as what leaves
this rank for other ranks (the copy to itself is not traffic). A mesh of None (no axis splits the
matrices: whole matrices on every rank) makes each of them the identity, with no traffic.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Optional, Sequence

import torch.distributed as dist
from torch import Tensor

from .mesh import MeshInfo

# torch ≥ 2.10 renamed all_gather_into_tensor (the old name warns); same arguments.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class Traffic:
    """Bytes sent by this rank in the current step, by purpose ("rows", "variance", "scores", ...)."""

    def __init__(self) -> None:
        self.by_kind: dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        self.by_kind[kind] += int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


class Pending:
    """An in-flight collective and the tensor it fills; `wait()` (once) returns that tensor,
    transformed, and drops this object's reference to it, so the caller alone decides how long
    the receive buffer lives (a whole bucket's worth of rows)."""

    def __init__(self, work, result: Tensor, finish: Optional[Callable[[Tensor], Tensor]] = None):
        self._work, self._result, self._finish = work, result, finish

    def wait(self) -> Tensor:
        if self._result is None:
            raise RuntimeError("this pending collective was already waited on; wait on each one once")
        if self._work is not None:
            self._work.wait()
        result, self._result, self._work = self._result, None, None
        return self._finish(result) if self._finish is not None else result


def _row_bytes(tensor: Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def exchange_rows(
    send: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
    mesh: Optional[MeshInfo], traffic: Traffic, kind: str,
) -> Pending:
    """All-to-all of dim-0 rows: send[...] is grouped by destination rank in `send_counts`."""
    send = send.contiguous()
    if mesh is None:
        return Pending(None, send)
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    traffic.add(kind, _row_bytes(send) * (sum(send_counts) - send_counts[mesh.rank]))
    work = dist.all_to_all_single(
        recv, send, list(recv_counts), list(send_counts), group=mesh.group, async_op=True
    )
    return Pending(work, recv)


def gather_chunks(chunk: Tensor, mesh: Optional[MeshInfo], traffic: Traffic, kind: str) -> Pending:
    """All-gather of equal chunks: returns [W, *chunk.shape] in rank order."""
    chunk = chunk.contiguous()
    if mesh is None:
        return Pending(None, chunk.unsqueeze(0))
    # Concatenated along dim 0 (the layout every backend accepts), viewed as [W, ...] after.
    out = chunk.new_empty((mesh.world_size * chunk.shape[0], *chunk.shape[1:]))
    traffic.add(kind, chunk.numel() * chunk.element_size() * (mesh.world_size - 1))
    work = _all_gather_single(out, chunk, group=mesh.group, async_op=True)
    return Pending(work, out, lambda gathered: gathered.view(mesh.world_size, *chunk.shape))


def sum_across(values: Tensor, mesh: Optional[MeshInfo], traffic: Traffic, kind: str) -> Pending:
    """All-reduce (sum) of a small tensor over the ranks (counted as a ring: 2·(W−1)/W of it)."""
    values = values.contiguous()
    if mesh is None:
        return Pending(None, values)
    traffic.add(kind, 2 * values.numel() * values.element_size() * (mesh.world_size - 1) // max(mesh.world_size, 1))
    work = dist.all_reduce(values, op=dist.ReduceOp.SUM, group=mesh.group, async_op=True)
    return Pending(work, values)

