"""Rerun one study run of Dion3, Muon or NorMuon up to a step and keep every matrix the guard skips (GPU).

    PYTHONPATH=src python3 benchmarks/skip_trace.py --model llama-hf-350m --lr 0.02 --fraction 0.5 \
        --seed 0 --stop 660 --out DIR
    PYTHONPATH=src python3 benchmarks/skip_trace.py --model llama-384 --batch-size 128 --optimizer muon \
        --lr 0.02 --mu 0.8 --seed 1 --stop 1500 --out DIR

The run is the study's (`python -m dion3.tools.study`: read-once data, 1500-step schedule with lr
warm-up 50 and cooldown 0.3, compiled model; Dion3 with fractions by cost and μ 0.6 unless given),
stopped after --stop steps. Muon and NorMuon step through the same matrix step and guard, so their
skips are kept alike. After every bucket the guard's verdict is read on the host (one sync per
bucket: this changes the step's timing, which is the point when the suspect is a race). Each
skipped matrix is saved to DIR/skip_STEP_N.pt (STEP 0-based, as the study's
`skipped_update_steps`) with Newton–Schulz's input U, its output O, the norm, the bound and the
selected rows, for a float64 replay; the log line gives ‖O‖_F against the bound and the cause
(`cause`): a non-finite gradient entry shows as a non-finite norm of a finite U (the momentum pass
keeps the momentum finite and measures NaN on that row, dion3.rules), a non-finite U as itself,
and a finite U of finite norm whose O is bad points at the orthogonalization.
"""
import argparse
import math
import os

import torch

from dion3 import rules
from dion3.tools.study.child import build_llama
from dion3.tools.study.runs import MODELS
from dion3.tools.train import trainer
from dion3.tools.train.corpus import python_source_corpus
from dion3.tools.train.model import GPTConfig


class Stop(Exception):
    """Raised after the last step wanted."""


def cause(u: torch.Tensor, norm) -> str:
    """Why a kept matrix was skipped, from Newton–Schulz's input U and its pre-step norm (None
    where the step did not measure one)."""
    if not bool(torch.isfinite(u).all()):
        return "a non-finite U"
    if norm is not None and not math.isfinite(float(norm)):
        return "a non-finite gradient (U finite, its norm not)"
    return "the orthogonalization (U and its norm finite)"


class SkipTrace:
    """Wraps rules.orthogonalize_rows (keeps the latest U) and rules.guard (checks the verdict)."""

    def __init__(self, out: str):
        self.out, self.step, self.saved, self.checked = out, 0, 0, 0
        self.last_input = None
        self._orthogonalize, self._guard = rules.orthogonalize_rows, rules.guard

    def install(self) -> None:
        rules.orthogonalize_rows, rules.guard = self.orthogonalize_rows, self.guard

    def orthogonalize_rows(self, update, method, coefficients, norm=None, normalized=False):
        data, rows, cols = (update, *update.shape[-2:]) if isinstance(update, torch.Tensor) else update
        kept_norm = None if norm is None else norm.float().reshape(-1).clone()
        self.last_input = (data[..., :rows, :cols].float().clone(), kept_norm, method, normalized)
        return self._orthogonalize(update, method, coefficients, norm, normalized)

    def guard(self, ortho, variance, rows, cfg, bound):
        scale, ok = self._guard(ortho, variance, rows, cfg, bound)
        self.checked += 1
        if not bool(ok.all()):
            self.keep(ortho, rows, bound, (~ok).nonzero().flatten())
        return scale, ok

    def keep(self, ortho, rows, bound, bad) -> None:
        u, norm, method, normalized = self.last_input
        o = ortho.float()
        o_norms = torch.linalg.vector_norm(o, dim=(-2, -1))
        limit = bound * math.sqrt(min(ortho.shape[-2:]))
        record = {
            "step": self.step, "bad": bad.cpu(), "bound": bound, "limit": limit, "shape": tuple(ortho.shape),
            "method": method, "normalized": normalized, "u": u[bad].cpu(), "o": o[bad].cpu(),
            "norm": None if norm is None else norm[bad].cpu(), "o_norms": o_norms.cpu(),
            "rows": None if rows is None else rows[bad].cpu(),
        }
        torch.save(record, os.path.join(self.out, f"skip_{self.step}_{self.saved}.pt"))
        self.saved += 1
        causes = [cause(u[i], None if norm is None else norm[i]) for i in bad.tolist()]
        print(f"skip at step {self.step}: bucket {tuple(ortho.shape)}, matrices {bad.tolist()}, {method}, "
              f"|O|_F {o_norms[bad].tolist()} against {limit:.2f}, caused by {'; '.join(causes)}", flush=True)

    def on_step(self, stop: int) -> None:
        self.step += 1
        if self.step % 100 == 0:
            print(f"step {self.step}: {self.checked} verdicts read, {self.saved} skips", flush=True)
        if self.step >= stop:
            raise Stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-hf-350m", choices=sorted(MODELS))
    parser.add_argument("--optimizer", default="dion3", choices=("dion3", "muon", "normuon"))
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--fraction", type=float, help="Dion3's fraction (by cost); needed for dion3 only")
    parser.add_argument("--mu", type=float, help="the run's μ (Dion3's default 0.6; Muon's and NorMuon's: give the record's)")
    parser.add_argument("--batch-size", type=int, help="sequences a step (default: the model's study batch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--horizon", type=int, default=1500, help="the schedule's length (the run's lr schedule)")
    parser.add_argument("--stop", type=int, required=True, help="steps to run (≤ --horizon)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not 0 < args.stop <= args.horizon:
        parser.error(f"--stop must be in 1..{args.horizon}, got {args.stop}")
    if (args.fraction is None) == (args.optimizer == "dion3"):
        parser.error(f"--fraction is Dion3's: give it with --optimizer dion3 only (got --optimizer {args.optimizer}"
                     f", --fraction {args.fraction})")
    if args.mu is None and args.optimizer != "dion3":
        parser.error(f"--mu: give the μ of the {args.optimizer} run traced (its record's config names it)")
    mu = 0.6 if args.mu is None else args.mu
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be ≥ 1, got {args.batch_size}")
    if not torch.cuda.is_available():
        parser.error("needs a GPU (the study's compiled bf16 run)")
    os.makedirs(args.out, exist_ok=True)
    spec = MODELS[args.model]
    if spec.kind != "llama-hf":
        parser.error(f"--model {args.model}: the trace follows the study's Llama runs only")
    trace = SkipTrace(args.out)
    trace.install()
    data = python_source_corpus(progress=lambda line: None)
    config = GPTConfig(seq_len=spec.seq_len, n_layer=spec.n_layer, n_head=spec.n_head, d_model=spec.d_model)
    schedule = trainer.Schedule(steps=args.horizon, batch_size=args.batch_size or spec.batch_size,
                                eval_every=args.horizon, eval_batches=16, warmup_steps=50, cooldown_fraction=0.3,
                                read_once=True)
    run = trainer.RunSpec("skip-trace", args.optimizer, args.lr, args.fraction, mu, 0,
                          "cost" if args.optimizer == "dion3" else "uniform")
    try:
        trainer.train(run, config, schedule, data, torch.device("cuda"), args.seed, bf16=True,
                      model_factory=build_llama(spec), compiled=True, on_step=lambda: trace.on_step(args.stop))
    except Stop:
        pass
    print(f"{trace.step} steps, {trace.checked} verdicts read, {trace.saved} skips", flush=True)


if __name__ == "__main__":
    main()
