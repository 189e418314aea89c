"""Overlap the memory-bound and compute-bound phases of a single-device step on two CUDA streams.

Each bucket's step is a generator with three phases, separated by `yield`:
    prepare  (momentum, scores, selection, snapshot)   memory-bound
    compute  (orthogonalize)                             compute-bound
    finish   (normalization factors, weight decay, update) memory-bound
Run in order on one stream, the GPU idles its memory system during the orthogonalizations and
its tensor cores during the elementwise passes. Here the prepare and finish phases of every
bucket run on a side stream and the compute phases on the caller's stream, ordered by events:
prepare(b) → compute(b) → finish(b) for each bucket b, buckets otherwise independent.

Memory safety without record_stream (which CUDA-graph capture does not allow): every
generator, and so every tensor one phase hands to the next, stays alive until both streams
have joined back, so no block is reused while the other stream may still read it. That keeps
each bucket's snapshot and orthogonalized update alive for the whole step (docs/memory.md).
"""
from __future__ import annotations

from typing import Iterator

import torch

_side_streams: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def run_phases_overlapped(steps: list[Iterator], device: torch.device) -> None:
    """Drive three-phase bucket steps (see module doc) on the current and a side stream."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)  # fork: the side stream sees everything enqueued before the step
    prepared = []
    with torch.cuda.stream(side):
        for step in steps:
            next(step, None)  # prepare (a step with nothing to do ends here)
            prepared.append(_recorded(side))
    computed = []
    for step, ready in zip(steps, prepared):
        main.wait_event(ready)
        next(step, None)  # compute
        computed.append(_recorded(main))
    with torch.cuda.stream(side):
        for step, ready in zip(steps, computed):
            side.wait_event(ready)
            next(step, None)  # finish
    main.wait_stream(side)  # join: later work on the caller's stream follows the whole step
    steps.clear()  # only now may the phases' tensors go back to the allocator


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def run_phases_in_order(steps: list[Iterator]) -> None:
    """The same phases, one bucket after another on the current stream (CPU, or overlap off)."""
    for step in steps:
        for _ in step:
            pass
