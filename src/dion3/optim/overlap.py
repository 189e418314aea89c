"""Single-device steps with the memory-bound passes beside Newton–Schulz (CUDA).

A bucket's step is a memory-bound pass over momentum and gradients (momentum, selection,
snapshot), compute-bound Newton–Schulz, and another memory-bound pass over the parameters
(normalization, update). One after another the step costs the sum of the two kinds of work; here
the passes run on a side stream while the main stream orthogonalizes: bucket i's Newton–Schulz
runs beside bucket i+1's momentum pass and bucket i−1's update. Large buckets are cut into chunks
of whole entries (views of the bucket's buffers, no copies), so that only the first chunk's
momentum pass and the last chunk's update are left alone on the GPU.

Every chunk is stepped exactly as it would be alone (the rules act per matrix), so the result
does not depend on the schedule. Tensors that cross between the streams are recorded on the
stream that reads them (the caching allocator must not reuse their memory early); the main
stream waits for the side stream before the step returns, so what follows the step (the next
forward, zero_grad) sees the updated parameters. Under CUDA graph capture the two streams become
two branches of the graph.

DION3_OVERLAP=0 in the environment or set_overlap_enabled(False) steps bucket after bucket.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Optional, Sequence

import torch

from ..buckets import Bucket, bucket_chunk

# Chunks of about this much momentum (fp32 Llama-8B: gate/up 15 GB → 8 chunks of 8 matrices,
# down 7.5 GB → 7, q/o 4.3 GB → 4); at most MAX_CHUNKS per bucket, whole entries each.
CHUNK_BYTES = 1 << 30
MAX_CHUNKS = 8
OVERLAP_MIN_BYTES = 256 << 20
_enabled = os.environ.get("DION3_OVERLAP", "1").strip().lower() not in ("0", "false", "off", "no")
_side_streams: dict = {}


def set_overlap_enabled(flag: bool) -> None:
    """Overlap memory-bound passes with Newton–Schulz on CUDA (True) or step bucket after bucket."""
    global _enabled
    _enabled = bool(flag)


def overlap_enabled() -> bool:
    return _enabled


def whole_step(bucket: Bucket) -> bool:
    """A bucket stepped whole (every entry has a gradient, stacked state): what may overlap."""
    return bucket.pieces is None and all(p.grad is not None for p in bucket.params)


def schedule(work: Sequence[tuple[dict, Bucket]]) -> Optional[list[tuple[dict, Bucket]]]:
    """The chunks to step overlapped, or None where stepping bucket after bucket is as good:
    overlap off, not on CUDA, less than OVERLAP_MIN_BYTES of momentum (launch-bound steps:
    streams and events would only add host time) or fewer than two pieces of work."""
    if not _enabled or not work or work[0][1].momentum.device.type != "cuda":
        return None
    if sum(b.momentum.numel() * b.momentum.element_size() for _, b in work) < OVERLAP_MIN_BYTES:
        return None
    pieces = chunked(work)
    return pieces if len(pieces) > 1 else None


def chunk_count(bucket: Bucket) -> int:
    size = bucket.momentum.numel() * bucket.momentum.element_size()
    return max(1, min(len(bucket.params), MAX_CHUNKS, math.ceil(size / CHUNK_BYTES - 0.5)))


def chunk_ranges(entries: int, chunks: int) -> list[tuple[int, int]]:
    """`chunks` contiguous ranges of entry indices, as even as whole entries allow."""
    bounds = [round(i * entries / chunks) for i in range(chunks + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def chunked(work: Sequence[tuple[dict, Bucket]]) -> list[tuple[dict, Bucket]]:
    pieces = []
    for group, bucket in work:
        ranges = chunk_ranges(len(bucket.params), chunk_count(bucket))
        pieces += [(group, bucket if len(ranges) == 1 else bucket_chunk(bucket, a, b)) for a, b in ranges]
    return pieces


class CudaStreams:
    """The stream operations overlapped_steps uses, on torch.cuda (tests substitute a recorder
    that runs everything inline and checks the order the dependencies allow)."""

    def current(self):
        return torch.cuda.current_stream()

    def side(self, main):
        device = main.device
        if device not in _side_streams:
            _side_streams[device] = torch.cuda.Stream(device=device)
        return _side_streams[device]

    def using(self, stream):
        return torch.cuda.stream(stream)

    def event(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream, other) -> None:
        stream.wait_stream(other)

    def read_on(self, values, stream) -> None:
        """Tensors made on one stream and read on `stream`: their memory must not be reused
        before `stream`'s reads are done."""
        for value in values:
            if isinstance(value, torch.Tensor):
                value.record_stream(stream)


def overlapped_steps(work: Sequence[tuple[dict, Bucket]], begin: Callable, orthogonalize: Callable,
                     finish: Callable, streams=None) -> None:
    """Step each (group, bucket) of `work`: begin(bucket, group) and finish(bucket, group,
    begun, ortho) on the side stream, orthogonalize(begun, group) on the current stream, in the
    order: begin 0; then for each i: orthogonalize i | begin i+1, finish i−1."""
    streams = streams or CudaStreams()
    main = streams.current()
    side = streams.side(main)
    streams.wait_stream(side, main)  # the gradients and parameters as the main stream left them

    def begin_on_side(i):
        group, bucket = work[i]
        with streams.using(side):
            begun = begin(bucket, group)
        streams.read_on(begun, main)
        return begun, streams.event(side)

    upcoming = begin_on_side(0)
    for i, (group, bucket) in enumerate(work):
        begun, ready = upcoming
        streams.wait_event(main, ready)  # this bucket's snapshot, not the side stream's later work
        ortho = orthogonalize(begun, group)
        streams.read_on([ortho], side)
        if i + 1 < len(work):
            upcoming = begin_on_side(i + 1)
        streams.wait_stream(side, main)  # Newton–Schulz of this bucket
        with streams.using(side):
            finish(bucket, group, begun, ortho)
    streams.wait_stream(main, side)
