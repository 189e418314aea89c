"""The overlapped single-device step (optim/overlap.py) on CPU: chunks of a bucket are views of
its state; the stream schedule, run by a recorder that executes inline and simulates the two
streams' timelines, respects every dependency and hides the memory-bound phases behind
Newton–Schulz; stepping overlapped gives the same parameters and state as a plain step."""
import contextlib
import copy

import pytest
import torch

from dion3 import Dion3, Muon, NorMuon
from dion3.buckets import bucket_chunk
from dion3.optim import overlap


class RecordingStreams:
    """Stand-in for CudaStreams: runs every phase at once (CPU) and records, per stream, the
    phases and waits in issue order; timeline() then plays them as two CUDA streams would."""

    def __init__(self):
        self.queues = {"main": [], "side": []}
        self.where = "main"
        self.read = []  # (tensor ids, stream) of read_on calls

    def current(self):
        return "main"

    def side(self, main):
        assert main == "main"
        return "side"

    @contextlib.contextmanager
    def using(self, stream):
        before, self.where = self.where, stream
        yield
        self.where = before

    def event(self, stream):
        return (stream, len(self.queues[stream]))  # everything issued on it so far

    def wait_event(self, stream, event) -> None:
        self.queues[stream].append(("wait", event))

    def wait_stream(self, stream, other) -> None:
        self.queues[stream].append(("wait", self.event(other)))

    def read_on(self, values, stream) -> None:
        self.read.append(([id(v) for v in values if isinstance(v, torch.Tensor)], stream))

    def phase(self, name, index, duration):
        self.queues[self.where].append(("run", (name, index), duration))

    def timeline(self):
        """Start and end of every phase when each stream runs its queue in order, a wait
        holding it until the awaited prefix of the other queue has finished."""
        done = {s: [] for s in self.queues}  # end time of each item of each queue, in order
        spans = {}
        while any(len(done[s]) < len(q) for s, q in self.queues.items()):
            progressed = False
            for stream, queue in self.queues.items():
                while len(done[stream]) < len(queue):
                    item = queue[len(done[stream])]
                    start = done[stream][-1] if done[stream] else 0.0
                    if item[0] == "wait":
                        other, count = item[1]
                        if len(done[other]) < count:
                            break  # the awaited prefix has not been played yet
                        end = max([start] + done[other][:count])
                    else:
                        end = start + item[2]
                        spans[item[1]] = (start, end, stream)
                    done[stream].append(end)
                    progressed = True
            assert progressed, "the two streams wait on each other"
        return spans, max(max(d) for d in done.values() if d)


def timed_phases(streams, durations):
    """The optimizer-independent phases of overlapped_steps, logging to the recorder."""
    def begin(bucket, group):
        streams.phase("begin", bucket, durations["begin"])
        return (torch.zeros(1),)

    def orthogonalize(begun, group):
        streams.phase("ortho", group, durations["ortho"])
        return torch.zeros(1)

    def finish(bucket, group, begun, ortho):
        streams.phase("finish", bucket, durations["finish"])
    return begin, orthogonalize, finish


@pytest.mark.parametrize("count", [1, 2, 5])
def test_schedule_keeps_each_chunks_order_and_hides_the_memory_passes(count):
    streams = RecordingStreams()
    work = [(i, i) for i in range(count)]  # (group, bucket): here just the chunk's index
    durations = {"begin": 1.0, "ortho": 3.0, "finish": 1.0}
    overlap.overlapped_steps(work, *timed_phases(streams, durations), streams=streams)
    spans, makespan = streams.timeline()
    for i in range(count):
        begin, ortho, finish = spans[("begin", i)], spans[("ortho", i)], spans[("finish", i)]
        assert (begin[2], ortho[2], finish[2]) == ("side", "main", "side")
        assert begin[1] <= ortho[0] and ortho[1] <= finish[0]  # each chunk's own order
    # Newton–Schulz back to back on the main stream: only the first momentum pass and the last
    # update are exposed (sequential: 5 per chunk)
    assert makespan == pytest.approx(1.0 + 3.0 * count + 1.0)
    # the main stream ends after the side stream's last update
    assert streams.queues["main"][-1] == ("wait", ("side", len(streams.queues["side"])))


def test_schedule_with_memory_passes_longer_than_newton_schulz():
    streams = RecordingStreams()
    work = [(i, i) for i in range(4)]
    overlap.overlapped_steps(work, *timed_phases(streams, {"begin": 2.0, "ortho": 1.0, "finish": 2.0}), streams=streams)
    spans, makespan = streams.timeline()
    # the side stream is the bottleneck and never idles: its eight phases back to back (each
    # Newton–Schulz, after its own momentum pass, is done before the side stream needs it)
    assert makespan == pytest.approx(4 * 2.0 + 4 * 2.0)
    assert spans[("ortho", 3)][1] <= spans[("finish", 3)][0]


def test_chunk_ranges_and_counts_by_hand():
    assert overlap.chunk_ranges(64, 8) == [(i * 8, i * 8 + 8) for i in range(8)]
    assert overlap.chunk_ranges(7, 2) == [(0, 4), (4, 7)]  # round(3.5) = 4
    assert overlap.chunk_ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]

    class Sized:
        def __init__(self, entries, gigabytes):
            self.params = [None] * entries
            self.momentum = torch.empty(0)
            self.size = gigabytes

    def count(entries, gigabytes):
        bucket = Sized(entries, gigabytes)
        bucket.momentum = type("M", (), {"numel": lambda self: int(gigabytes * (1 << 30)), "element_size": lambda self: 1})()
        return overlap.chunk_count(bucket)

    # Llama-8B fp32 buckets: gate/up 15.0 GB, down 7.5, q/o 4.29, k/v 1.07 (64, 32, 64, 64 entries)
    assert [count(64, 14.0), count(32, 7.0), count(64, 4.0), count(64, 1.0)] == [8, 7, 4, 1]
    assert count(2, 14.0) == 2  # never more chunks than entries
    assert count(8, 0.3) == 1


def _model_params(seed=0):
    torch.manual_seed(seed)
    shapes = [(48, 32)] * 5 + [(16, 32)] * 3 + [(64, 16)] * 2
    return [torch.nn.Parameter(torch.randn(s)) for s in shapes]


@pytest.mark.parametrize("make", [
    lambda p: Dion3(p, lr=0.02, fraction=0.25, weight_decay=0.1),
    lambda p: NorMuon(p, lr=0.02, weight_decay=0.1),
    lambda p: Muon(p, lr=0.02, weight_decay=0.1),
])
def test_overlapped_chunks_step_like_the_plain_step(monkeypatch, make):
    plain_params, chunked_params = _model_params(), _model_params()
    plain, chunked = make(plain_params), make(chunked_params)
    monkeypatch.setattr(overlap, "CHUNK_BYTES", 2 * 48 * 32 * 4)  # two matrices a chunk
    for step in range(3):
        torch.manual_seed(100 + step)
        grads = [torch.randn(p.shape) for p in plain_params]
        for p, q, g in zip(plain_params, chunked_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        plain.step()
        work = [(g, b) for g, buckets in zip(chunked.param_groups, chunked._buckets) for b in buckets]
        pieces = overlap.chunked(work)
        assert len(pieces) == 2 + 1 + 1  # the five 48×32 matrices: 2.5 chunks of size, so two
        streams = RecordingStreams()
        overlap.overlapped_steps(pieces, chunked._begin_matrix_step, chunked._orthogonalize_step,
                                 chunked._finish_matrix_step, streams=streams)
    for p, q in zip(plain_params, chunked_params):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
        for key in plain.state[p]:
            torch.testing.assert_close(chunked.state[q][key], plain.state[p][key], rtol=0, atol=1e-6)


def test_a_chunk_steps_the_buckets_own_state():
    params = _model_params()
    optimizer = Dion3(params, lr=0.02, fraction=0.25)
    bucket = next(b for b in optimizer._buckets[0] if b.shape == (48, 32))
    chunk = bucket_chunk(bucket, 1, 3)
    assert chunk.params == bucket.params[1:3]
    assert chunk.momentum.data_ptr() == bucket.momentum[1].data_ptr() and chunk.momentum.shape[0] == 2
    assert chunk.variance.data_ptr() == bucket.variance[1].data_ptr()
    chunk.momentum.fill_(3.0)
    assert torch.equal(optimizer.state[params[2]]["momentum"], torch.full((48, 32), 3.0))
    assert not optimizer.state[params[0]]["momentum"].any()


def test_schedule_declines_on_cpu_and_when_disabled():
    params = _model_params()
    optimizer = Dion3(params)
    work = [(g, b) for g, buckets in zip(optimizer.param_groups, optimizer._buckets) for b in buckets]
    assert overlap.schedule(work) is None  # CPU tensors: bucket after bucket


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("make", [
    lambda p: Dion3(p, lr=0.02, fraction=0.25, weight_decay=0.1),
    lambda p: NorMuon(p, lr=0.02, weight_decay=0.1),
])
def test_overlapped_gpu_step_equals_bucket_after_bucket(monkeypatch, make, captured):
    """On CUDA streams (eager and captured), over 8 steps: the same parameters and state as
    with overlap off. The schedule moves no arithmetic, but a chunk is a smaller batch, for
    which cuBLAS may pick another kernel: rounding of bf16 Newton–Schulz output (relative 4e-3
    of an update of ~6e-4 per entry per step) is all that may differ; a race or a missed
    wait would show as whole updates (≥ 1e-4) off."""
    from dion3.optim.graph import CapturedStep, to_device_scalars

    torch.manual_seed(0)
    shapes = [(1024, 1024)] * 6 + [(256, 1024)] * 4 + [(2048, 512)] * 3
    plain_params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    overlapped_params = [torch.nn.Parameter(p.detach().clone()) for p in plain_params]
    plain, overlapped = make(plain_params), make(overlapped_params)
    monkeypatch.setattr(overlap, "OVERLAP_MIN_BYTES", 0)
    monkeypatch.setattr(overlap, "CHUNK_BYTES", 2 * 1024 * 1024 * 4)  # 3 chunks of the 1024² bucket
    assert len(overlap.schedule([(g, b) for g, bs in zip(overlapped.param_groups, overlapped._buckets) for b in bs])) == 5
    stepped = {}
    for name, optimizer in (("plain", plain), ("overlapped", overlapped)):
        if captured:
            to_device_scalars(optimizer, torch.device("cuda"))
            stepped[name] = CapturedStep(optimizer, warmup_steps=3)
        else:
            stepped[name] = optimizer.step
    for step in range(8):
        torch.manual_seed(10 + step)
        grads = [torch.randn(s, device="cuda") for s in shapes]
        for p, q, g in zip(plain_params, overlapped_params, grads):
            p.grad = g.clone()
            q.grad = g.clone()
        overlap.set_overlap_enabled(False)
        try:
            stepped["plain"]()
        finally:
            overlap.set_overlap_enabled(True)
        stepped["overlapped"]()
    torch.cuda.synchronize()
    for p, q in zip(plain_params, overlapped_params):
        torch.testing.assert_close(q, p, rtol=0, atol=2e-5)
        for key in plain.state[p]:
            torch.testing.assert_close(overlapped.state[q][key], plain.state[p][key], rtol=1e-3, atol=1e-6)
