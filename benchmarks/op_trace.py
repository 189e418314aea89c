"""Records every operation inside Newton–Schulz (symmetric products, Gram products, casts,
batched products) during a traced optimizer step, so that the first operation whose output goes
bad for a matrix can be named, and run again on its recorded operands.

nonfinite_trace.py installs it with DION3_TRACE_OPS=1. Each operation's operands and output are
copied on the device (no host sync); after the step, for each bad matrix, `first_bad` finds the
first operation whose output for that matrix is not finite or larger than LIMIT, and `rerun`
runs it again (fresh outputs) to tell a wrong result for these operands (it reproduces) from a
fault of the moment (it does not).
"""
from __future__ import annotations

import importlib
import math

import torch

LIMIT = 1e4  # |entry| no product of normalized Newton–Schulz reaches (Q stays below ~40)


def _same(a, b) -> bool:
    """Equal entry for entry, NaN matching NaN (a product gone bad is still traced)."""
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


class _TorchWithTracedProducts:
    """The torch module as newton_schulz sees it, with bmm/baddbmm recorded."""

    def __init__(self, recorder: "OpRecorder"):
        self._recorder = recorder

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in ("bmm", "baddbmm"):
            return self._recorder.wrap(name, value)
        return value


class OpRecorder:
    def __init__(self):
        self.module = importlib.import_module("dion3.ortho.newton_schulz")
        self.records: list = []  # (call, name, function, operands, kwargs, output copy, max|out| per matrix)
        self.call = None  # the orthogonalization call being recorded (None: not inside one)
        for name in ("symmetric_matmul", "gram_with_copy", "contiguous_cast", "scale_cast"):
            setattr(self.module, name, self.wrap(name, getattr(self.module, name)))
        self.module.torch = _TorchWithTracedProducts(self)

    def wrap(self, name, function):
        def recorded(*args, **kwargs):
            out = function(*args, **kwargs)
            if self.call is not None:
                first = out[0] if isinstance(out, tuple) else out
                copies = tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args)
                batched = first.reshape(-1, *first.shape[-2:]) if first.dim() >= 2 else first.reshape(1, -1, 1)
                size = torch.nan_to_num(batched.detach().float().abs().amax(dim=(-2, -1)), nan=math.inf)
                self.records.append((self.call, name, function, copies, dict(kwargs), first.detach().clone(), size))
            return out
        return recorded

    def first_bad(self, call: int, matrix: int) -> dict:
        """For one bad matrix of `call` (after the step; a few host syncs): the size of every
        recorded operation's output, the first output that is not finite or above LIMIT, and
        the whole chain checked (audit)."""
        ops = [r for r in self.records if r[0] == call]
        sizes = [float(r[6][matrix]) if r[6].numel() > matrix else float(r[6].max()) for r in ops]
        sequence = [f"{r[1]}:{s:.3g}" for r, s in zip(ops, sizes)]
        found = {"first_bad_op": None, "sizes": sequence, "record": None, "audit": self.audit(ops, matrix)}
        for position, (record, size) in enumerate(zip(ops, sizes)):
            if not math.isfinite(size) or size > LIMIT:
                found.update(first_bad_op=record[1], position=position, record=record)
                break
        return found

    @staticmethod
    def _slice(t, matrix: int):
        return t.reshape(-1, *t.shape[-2:])[matrix] if t.dim() >= 2 and t.reshape(-1, *t.shape[-2:]).shape[0] > matrix else t

    @staticmethod
    def _source(operand, outputs: list):
        """The latest earlier output this operand equals: its index, "i+aI" when it equals it
        plus a constant on the diagonal (Gram NS builds Q = Z + a·I in Z's memory), its
        transpose counting as itself; "input" when it equals none."""
        for earlier in range(len(outputs) - 1, -1, -1):
            candidate = outputs[earlier]
            for view in (candidate, candidate.mT if candidate.dim() >= 2 else candidate):
                if view.shape != operand.shape:
                    continue
                if _same(view, operand):
                    return earlier
                if operand.dim() >= 2 and operand.shape[-1] == operand.shape[-2]:
                    off = ~torch.eye(operand.shape[-1], dtype=torch.bool, device=operand.device)
                    mine = operand.diagonal(dim1=-2, dim2=-1).float()
                    theirs = view.diagonal(dim1=-2, dim2=-1).float()
                    shift = mine - theirs
                    finite = torch.isfinite(shift)
                    constant = False
                    if bool(finite.any()):  # one a for every diagonal entry (absorbed where |Z| ≫ a)
                        a = shift[finite].median()
                        close = torch.isclose(mine, theirs + a, rtol=1e-2, atol=1e-3)
                        constant = bool((close | (torch.isnan(mine) & torch.isnan(theirs + a))
                                         | (torch.isinf(mine) & (mine == theirs))).all())
                    if _same(operand[..., off], view[..., off]) and constant:
                        return f"{earlier}+aI"
        return "input"

    def audit(self, ops: list, matrix: int) -> list:
        """Per operation, in order: does running it again on its recorded operands give its
        recorded output (for this matrix, to half-precision rounding)? And is each tensor operand
        exactly an earlier operation's output (the index of the latest one it equals, "input" for
        none among them, the call's input being the first operand of the first operation)? An
        operation whose rerun differs computed wrongly at that moment; an operand that equals no
        earlier output (where one should) changed between the operations."""
        report = []
        outputs = []
        for position, (_, name, function, operands, kwargs, recorded, _) in enumerate(ops):
            again = function(*[a.clone() if torch.is_tensor(a) else a for a in operands], **kwargs)
            again = again[0] if isinstance(again, tuple) else again
            mine, now = self._slice(recorded, matrix).float(), self._slice(again, matrix).float()
            both = torch.isfinite(mine) & torch.isfinite(now)
            scale = float(now[both].abs().max()) if bool(both.any()) else 1.0
            difference = float((now - mine)[both].abs().max()) / (scale or 1.0) if bool(both.any()) else 0.0
            if not torch.equal(torch.isfinite(mine), torch.isfinite(now)):
                difference = math.inf  # not finite in one run only
            sources = [self._source(operand, outputs) for operand in operands if torch.is_tensor(operand)]
            report.append({"op": name, "rerun_relative_difference": difference, "operands_from": sources})
            outputs.append(recorded)
        return report

    @staticmethod
    def rerun(record, matrix: int, repeats: int = 8) -> dict:
        """Run the operation again on its recorded operands: does the bad output come back?"""
        _, name, function, operands, kwargs, recorded, _ = record
        again = []
        for _ in range(repeats):
            out = function(*[a.clone() if torch.is_tensor(a) else a for a in operands], **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            again.append(out.reshape(-1, *out.shape[-2:])[matrix] if out.dim() >= 2 else out)
        mine = recorded.reshape(-1, *recorded.shape[-2:])[matrix] if recorded.dim() >= 2 else recorded
        return {"op": name, "rerun_identical_to_recorded": [bool(torch.equal(a, mine)) for a in again],
                "rerun_finite": [bool(torch.isfinite(a).all()) for a in again],
                "rerun_max_abs": [float(a.float().abs().max()) for a in again],
                "operand_max_abs": [float(torch.nan_to_num(a.float().abs(), nan=math.inf).max()) if torch.is_tensor(a) else repr(a)
                                    for a in operands],
                "operand_shapes": [list(a.shape) if torch.is_tensor(a) else None for a in operands],
                "operand_strides": [list(a.stride()) if torch.is_tensor(a) else None for a in operands]}

    def clear(self) -> None:
        self.records.clear()
