"""The study's command line (`python -m dion3.tools.study`; the package docstring says what it does)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..models import refusal
from .child import run_one
from .launch import pending, read_results, run_study
from .runs import FAMILIES, MODELS, Run, plan_best_runs, plan_runs
from .summary import write_summary

SMOKE = dict(model="gpt-tiny", horizons="8", seeds="0,1", optimizers="normuon,dion3", normuon_lr="0.02", normuon_mu="0.6",
             dion3_lr="0.04", dion3_mu="0.3", fraction_warmup="0,4", lr_warmup=2, eval_batches=2, device="cpu", jobs=2,
             data=["stdlib"])


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dion3.tools.study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-25m", metavar="NAME",
                        help=f"the model to train: {', '.join(sorted(MODELS))} (default gpt-25m)")
    parser.add_argument("--horizons", default="400,1500,4000", help="training steps per run, comma-separated")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--optimizers", default=",".join(FAMILIES), help="families to run (default: %(default)s)")
    for family, (lr, mu) in FAMILIES.items():
        parser.add_argument(f"--{family}-lr", default=lr, help=f"{family} matrix learning rates (default {lr})")
        if mu:
            parser.add_argument(f"--{family}-mu", default=mu, help=f"{family} momenta (default {mu})")
    parser.add_argument("--fraction", default="0.25",
                        help="Dion3's (final) fractions, comma-separated (with --fraction-allocation cost: the uniform "
                             "fraction within whose modeled H200 step time the per-shape fractions are allocated)")
    parser.add_argument("--fraction-warmup", default="0,200",
                        help="Dion3 fraction warm-ups from 1, comma-separated: steps, or P%% of the horizon; 0 = fixed fraction")
    parser.add_argument("--fraction-allocation", default="uniform",
                        help="Dion3 fractions, comma-separated: uniform (--fraction on every matrix), cost (per "
                             "matrix shape, within the uniform fraction's modeled H200 step time, dion3.ortho.cost.modeled_seconds; "
                             "a --fraction-warmup warms that budget up) and/or most_rows (as cost, the most rows that "
                             "time buys: param_groups' fraction_allocation)")
    parser.add_argument("--row-score", default="l1",
                        help="Dion3's selection score, comma-separated: l1 (each momentum row's L1 norm, the rule) "
                             "and/or l2 (its L2 norm); each Dion3 setting runs with each")
    parser.add_argument("--fraction-weights", nargs="+", default=["none"], metavar="SPEC",
                        help="with --fraction-allocation cost: weights of the rows by parameter name, each SPEC "
                             "part=weight pairs (e.g. mlp=2 or q_proj=2,o_proj=2) or none; each Dion3 setting runs "
                             "with each (param_groups' fraction_weights)")
    parser.add_argument("--unselected-decay", default="1", metavar="VALUES",
                        help="Dion3's decay of the momentum rows a step does not select, comma-separated, each in "
                             "(0, 1]: 1 (default, the rule: they keep accumulating) and/or d < 1 (M[~S] ← d·M[~S], "
                             "an experiment); each Dion3 setting runs with each")
    parser.add_argument("--full-every", default="0", metavar="K",
                        help="Dion3 runs that orthogonalize every row on every K-th step and the fraction on the others "
                             "(dion3.PeriodicFull; by cost: budget 1 on those steps), comma-separated; 0 (default): "
                             "never; each Dion3 setting runs with each")
    parser.add_argument("--ns-coefficients", default="polar_express", metavar="NAMES",
                        help="Newton–Schulz schedules, comma-separated names of dion3.ortho.SCHEDULES (default "
                             "polar_express, 5 steps; polar_express_4 and polar_express_3 take 4 and 3); each Muon, "
                             "NorMuon and Dion3 setting runs with each")
    parser.add_argument("--momentum-dtype", default="float32",
                        help="the matrix momentum's dtype, comma-separated: float32 (default) and/or bfloat16; each "
                             "Muon, NorMuon and Dion3 setting runs with each (AdamW keeps its own state)")
    parser.add_argument("--captured", action="store_true", help="optimizer steps through CapturedStep (CUDA graphs)")
    parser.add_argument("--compile", action="store_true",
                        help="the model's forward and backward through torch.compile (same math, fused kernels; the "
                             "summary lists compiled runs as their own settings)")
    parser.add_argument("--best-from", type=Path, nargs="+", metavar="RESULTS",
                        help="studies' results.jsonl files (or their folders): instead of the lr/μ grids, run the best "
                             "setting of each family and Dion3 variant there (at --best-at steps) at --horizons with --seeds")
    parser.add_argument("--best-at", type=int, default=1500, help="the horizon whose losses pick the best (default 1500)")
    parser.add_argument("--repeats", type=int, default=1, help="run each setting and seed this many times (default 1)")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default: the model's, 16)")
    parser.add_argument("--lr-warmup", type=int, default=20, help="lr warm-up steps (default 20)")
    parser.add_argument("--cooldown", type=float, default=0.4, help="share of the steps with linear lr decay to 0")
    parser.add_argument("--eval-batches", type=int, default=16, help="validation batches at the end of each run")
    parser.add_argument("--data", nargs="+", metavar="PATH",
                        help="text files/directories or .bin shards; 'stdlib' for the standard library "
                             "(default: all installed Python source, dion3.tools.train.corpus)")
    parser.add_argument("--allow-repeat", action="store_true",
                        help="random windows that may read bytes more than once (default: each byte at most once)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each its own process (default 1)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]; comma-separated to spread runs over devices")
    parser.add_argument("--threads", type=int, help="CPU threads per run (default: CPU cores ÷ jobs)")
    parser.add_argument("--stop-after", type=float, metavar="MINUTES", help="start no run after this many minutes")
    parser.add_argument("--out", type=Path, help="output directory (default benchmarks/results/quality-study-<model>)")
    parser.add_argument("--smoke", action="store_true", help="tiny GPT on the CPU, a few steps: checks the machinery in seconds")
    parser.add_argument("--summary-only", action="store_true", help="rewrite summary.md from results.jsonl and stop")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the planned runs (done or to run, with --best-from's choices) and stop: plan device time")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)  # internal: one run's settings, as JSON
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)  # internal: where --run-one writes
    parser.add_argument("--runs-at-once", type=int, help=argparse.SUPPRESS)  # internal: the launching study's --jobs
    args = parser.parse_args(argv)
    if args.smoke:
        defaults = {action.dest: action.default for action in parser._actions}
        for name, value in SMOKE.items():
            if getattr(args, name) == defaults[name]:  # smoke values unless given on the command line
                setattr(args, name, value)
    if args.model not in MODELS:  # e.g. llama-8b, which `dion3 bench` and `dion3 plan` take: say so
        parser.error(f"--model: {refusal(args.model, 'study')}")
    for name in ("jobs", "eval_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.run_one:
        settings = json.loads(args.run_one)
        settings["data"] = tuple(settings["data"]) if settings["data"] else None
        record = run_one(Run(**settings), args.device, args.threads)
        if args.runs_at_once:  # not part of the setting: the same run alone or in a crowd has one key
            record["runs_at_once"] = args.runs_at_once
        args.result.write_text(json.dumps(record))
        return 0
    out = args.out or Path(f"quality-study-{args.model}")
    if not args.summary_only:
        devices = [d.strip() for d in args.device.split(",") if d.strip()]
        threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
        if args.best_from:
            records = [record for path in args.best_from
                       for record in read_results(path / "results.jsonl" if path.is_dir() else path)]
            runs = plan_best_runs(args, records)
        else:
            runs = plan_runs(args)
        if args.dry_run:
            todo = pending(runs, out / "results.jsonl")
            for run in runs:
                print(f"{'to run' if run in todo else 'done  '}  {run.label}")
            print(f"{len(runs)} runs, {len(runs) - len(todo)} already in {out / 'results.jsonl'}, {len(todo)} to run, "
                  f"{sum(run.horizon for run in todo)} steps in all")
            return 0
        if MODELS[args.model].kind == "llama-hf" and importlib.util.find_spec("transformers") is None:
            raise SystemExit("quality_study: --model llama-hf needs transformers: pip install 'dion3[study]'")
        failures = run_study(runs, out, args.jobs, devices, threads, args.stop_after)
    else:
        failures = 0
    table = write_summary(out)
    print(f"\n{table}\n\nwrote {out / 'summary.md'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
