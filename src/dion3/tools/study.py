"""Quality study: AdamW, Muon and NorMuon against Dion3 (fixed fraction, and with a fraction
warm-up) at several horizons, seeds and small lr/μ grids, on models users can rebuild
(docs/training.md).

    python -m dion3.tools.study --model llama-384 --horizons 1500 --seeds 0,1,2 --jobs 12 --out DIR
    python -m dion3.tools.study --smoke            # CPU, seconds: what CI runs

Data is read at most once per run: by default the installed Python source (dion3.tools.train.corpus,
300+ MB on a machine with torch), cut into disjoint windows taken in an order drawn from the
seed; a run that would need more windows than the corpus holds is refused. `--data` trains on
your files or shards instead, `--data stdlib` on the standard library alone (11 MB), and
`--allow-repeat` draws random windows that may overlap (a repeated corpus measures
memorization: such a study says so in its summary).

Every run is a separate process (several at once with --jobs: small models leave most of an
H200 idle), trains from its seed on the same batches as every other run of that seed, and when
it finishes appends one JSON line to OUT/results.jsonl: its settings, seed, horizon, final
validation loss, average fraction, step times and optimizer FLOPs. A study that is stopped keeps what finished,
and running it again skips those runs. OUT/summary.md gets the table: mean ± standard
deviation over seeds per setting and horizon; a run whose loss is not finite is never averaged:
the table counts it in its own column. Step times are measured with --jobs runs sharing the
device: compare them within one study, or rerun with --jobs 1 for clean times.

Models: gpt-25m (`dion3 compare --preset gpu-small`'s GPT, 8 × 512, context 1024), gpt-120m
(16 × 768, 113 M parameters in the blocks), llama-hf (Hugging Face LlamaForCausalLM, 8 × 512, GQA
8/4 heads, SwiGLU 1536, context 512; needs `pip install 'dion3[study]'`), llama-384 (the same
class, 12 × 384, GQA 6/2 heads, SwiGLU 1024, batch 32 × 512), llama-hf-110m and llama-hf-350m
(llama-hf's family at 16 × 768 and 24 × 1024, 110 M and 340 M matrix parameters in the blocks, the
same 16 × 512 tokens per step: the scale trend), gpt-tiny (--smoke). All train
with bf16 autocast on CUDA, an lr warm-up (--lr-warmup) and a linear decay to zero over the last
share of the steps (--cooldown).

`--fraction-allocation uniform,cost` adds Dion3 runs whose fraction is chosen per matrix shape by
cost within the modeled step time of the uniform --fraction (dion3.optim.cost_fractions; fixed
fractions only). Records from before 2026-12-03 allocated by executed FLOPs instead: their
config has no `cost_rule`, and they are labelled `-cost-flops`. Every record carries `optimizer_tflop`, the executed orthogonalization FLOPs of
its steps, so settings can be compared at equal optimizer FLOPs as well as at equal steps.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

SRC = Path(__file__).resolve().parents[2]  # the folder holding the dion3 package, for the runs' processes
if SRC.is_dir() and str(SRC) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(SRC))


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "gpt" (dion3.tools.train.model.GPT) or "llama-hf"
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    batch_size: int
    kv_heads: int = 0  # llama-hf only
    mlp_width: int = 0  # llama-hf only


MODELS = {
    "gpt-tiny": ModelSpec("gpt", seq_len=32, n_layer=2, n_head=2, d_model=64, batch_size=4),
    "gpt-25m": ModelSpec("gpt", seq_len=1024, n_layer=8, n_head=8, d_model=512, batch_size=16),
    "gpt-120m": ModelSpec("gpt", seq_len=1024, n_layer=16, n_head=12, d_model=768, batch_size=16),
    "llama-hf": ModelSpec("llama-hf", seq_len=512, n_layer=8, n_head=8, d_model=512, batch_size=16, kv_heads=4, mlp_width=1536),
    "llama-384": ModelSpec("llama-hf", seq_len=512, n_layer=12, n_head=6, d_model=384, batch_size=32, kv_heads=2, mlp_width=1024),
    # The scale trend: llama-hf's family (GQA, head width 64, SwiGLU) at about 110 M and 340 M matrix
    # parameters in the blocks (llama-hf: 25 M), with llama-hf's 16 × 512 tokens per step.
    "llama-hf-110m": ModelSpec("llama-hf", seq_len=512, n_layer=16, n_head=12, d_model=768, batch_size=16, kv_heads=4, mlp_width=2304),
    "llama-hf-350m": ModelSpec("llama-hf", seq_len=512, n_layer=24, n_head=16, d_model=1024, batch_size=16, kv_heads=8, mlp_width=3584),
}
# family → (lr flag default, μ flag default or None where the family has no μ)
FAMILIES = {"adamw": ("0.003", None), "muon": ("0.02", "0.95"), "normuon": ("0.02", "0.6,0.8"), "dion3": ("0.04,0.08", "0.3,0.6")}
SMOKE = dict(model="gpt-tiny", horizons="8", seeds="0,1", optimizers="normuon,dion3", normuon_lr="0.02", normuon_mu="0.6",
             dion3_lr="0.04", dion3_mu="0.3", fraction_warmup="0,4", lr_warmup=2, eval_batches=2, device="cpu", jobs=2,
             data=["stdlib"])
FRACTION_ALLOCATIONS = ("uniform", "cost")  # Dion3's fractions: dion3.optim.param_groups.FRACTION_ALLOCATIONS


# ----------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class Run:
    model: str
    optimizer: str  # "adamw", "muon", "normuon" or "dion3"
    lr: float
    mu: float
    fraction: Optional[float]  # dion3 only
    fraction_warmup: int  # dion3 only: steps of the linear warm-up from 1 (0: fixed fraction)
    horizon: int
    seed: int
    batch_size: int
    lr_warmup: int
    cooldown: float
    eval_batches: int
    data: Optional[tuple[str, ...]]
    read_once: bool = True  # disjoint windows (data.read_once_batches); False: random, may repeat
    repeat: int = 0  # the same run again (--repeats: GPU runs are not bit-reproducible; stress tests)
    captured: bool = False  # optimizer steps through CapturedStep (CUDA only)
    fraction_allocation: str = "uniform"  # dion3 only: "uniform" or "cost" (per matrix shape, trainer.RunSpec)
    compiled: bool = False  # forward and backward through torch.compile (trainer.train)
    momentum_dtype: Optional[str] = None  # Muon/NorMuon/Dion3: the matrix momentum's dtype; None: float32
    # fractions by cost: "time" (modeled step time, the rule since 2026-12-03); None in the records
    # of earlier runs, which allocated by executed FLOPs (and in every uniform run)
    cost_rule: Optional[str] = None

    @property
    def setting(self) -> tuple:
        """What the seeds of one setting share (the summary averages over seeds)."""
        return (self.model, self.horizon, self.optimizer, self.fraction, self.fraction_warmup, self.lr, self.mu,
                self.fraction_allocation, self.compiled, self.momentum_dtype, self.cost_rule)

    @property
    def key(self) -> str:
        fields = dataclasses.asdict(self)
        # the keys of runs from before these fields stay valid
        if fields["fraction_allocation"] == "uniform":
            del fields["fraction_allocation"]
        if not fields["compiled"]:
            del fields["compiled"]
        if fields["momentum_dtype"] is None:
            del fields["momentum_dtype"]
        if fields["cost_rule"] is None:
            del fields["cost_rule"]
        return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def label(self) -> str:
        if self.optimizer != "dion3":
            name = self.optimizer
        else:
            cost = "" if self.fraction_allocation == "uniform" else "-cost" if self.cost_rule else "-cost-flops"
            name = (f"dion3-f{self.fraction:g}" + cost
                    + (f"-warm{self.fraction_warmup}" if self.fraction_warmup else ""))
        if self.momentum_dtype:
            name += f"-momentum-{self.momentum_dtype}"
        return f"{name} lr={self.lr:g} mu={self.mu:g} h={self.horizon} seed={self.seed}" + (f" #{self.repeat}" if self.repeat else "")


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"quality_study: {flag} expects comma-separated numbers, got {text!r}") from None
    if not values:
        raise SystemExit(f"quality_study: {flag} is empty")
    return values


def _ints(text: str, flag: str) -> list[int]:
    values = _floats(text, flag)
    if any(v != int(v) or v < 0 for v in values):
        raise SystemExit(f"quality_study: {flag} expects comma-separated integers ≥ 0, got {text!r}")
    return [int(v) for v in values]


def warmup_steps(spec: str, horizon: int) -> int:
    """"200" → 200 steps; "15%" → 15% of the horizon."""
    spec = spec.strip()
    try:
        if spec.endswith("%"):
            return round(float(spec[:-1]) / 100 * horizon)
        return int(spec)
    except ValueError:
        raise SystemExit(f"quality_study: --fraction-warmup expects steps or P%, got {spec!r}") from None


MOMENTUM_DTYPES = ("float32", "bfloat16")


def momentum_dtypes(text: str) -> list[Optional[str]]:
    """--momentum-dtype → the Run field per dtype: None for float32 (the default, and the key of
    runs from before the option), else the dtype's name."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names or any(name not in MOMENTUM_DTYPES for name in names):
        raise SystemExit(f"quality_study: --momentum-dtype expects some of {MOMENTUM_DTYPES}, got {text!r}")
    return [None if name == "float32" else name for name in names]


def with_momentum_dtypes(runs: Sequence[Run], dtypes: Sequence[Optional[str]]) -> list[Run]:
    """Each run once per momentum dtype; AdamW runs once (it has no matrix momentum)."""
    out = []
    for run in runs:
        for dtype in (dtypes if run.optimizer != "adamw" else [None]):
            out.append(dataclasses.replace(run, momentum_dtype=dtype))
    return list(dict.fromkeys(out))


def plan_runs(args: argparse.Namespace) -> list[Run]:
    """Every run of the study, short horizons first (a partial study then covers every setting)."""
    horizons, seeds = sorted(set(_ints(args.horizons, "--horizons"))), _ints(args.seeds, "--seeds")
    if any(h < 1 for h in horizons):
        raise SystemExit("quality_study: --horizons must be positive")
    families = [f.strip() for f in args.optimizers.split(",") if f.strip()]
    for family in families:
        if family not in FAMILIES:
            raise SystemExit(f"quality_study: --optimizers: unknown {family!r}; expected some of {tuple(FAMILIES)}")
    fractions = list(dict.fromkeys(_floats(args.fraction, "--fraction")))
    if any(not 0.0 < f <= 1.0 for f in fractions):
        raise SystemExit(f"quality_study: --fraction values must lie in (0, 1], got {args.fraction!r}")
    allocations = list(dict.fromkeys(a.strip() for a in args.fraction_allocation.split(",") if a.strip()))
    if not allocations or any(a not in FRACTION_ALLOCATIONS for a in allocations):
        raise SystemExit(f"quality_study: --fraction-allocation expects some of {FRACTION_ALLOCATIONS}, "
                         f"got {args.fraction_allocation!r}")
    model = MODELS[args.model]
    common = dict(model=args.model, batch_size=args.batch_size or model.batch_size, lr_warmup=args.lr_warmup,
                  cooldown=args.cooldown, eval_batches=args.eval_batches, data=tuple(args.data) if args.data else None,
                  read_once=not args.allow_repeat, captured=args.captured, compiled=args.compile)
    if args.repeats < 1:
        raise SystemExit(f"quality_study: --repeats must be ≥ 1, got {args.repeats}")
    runs = []
    for horizon, seed in itertools.product(horizons, seeds):
        for family in (f for f in FAMILIES if f != "dion3" and f in families):
            lrs = _floats(getattr(args, f"{family}_lr"), f"--{family}-lr")
            mus = _floats(getattr(args, f"{family}_mu"), f"--{family}-mu") if FAMILIES[family][1] else [0.0]
            for lr, mu in itertools.product(lrs, mus):
                runs.append(Run(optimizer=family, lr=lr, mu=mu, fraction=None, fraction_warmup=0, horizon=horizon, seed=seed, **common))
        if "dion3" in families:
            warmups = [warmup_steps(w, horizon) for w in args.fraction_warmup.split(",") if w.strip()]
            if "cost" in allocations and any(warmups):
                # FractionScheduler sets one fraction on every group: it would undo the per-shape fractions
                raise SystemExit("quality_study: --fraction-allocation cost needs fixed fractions: add "
                                 f"--fraction-warmup 0 (got warm-ups {sorted(set(warmups))} at horizon {horizon})")
            for fraction, lr, mu, warm, allocation in itertools.product(
                    fractions, _floats(args.dion3_lr, "--dion3-lr"), _floats(args.dion3_mu, "--dion3-mu"),
                    dict.fromkeys(warmups), allocations):
                runs.append(Run(optimizer="dion3", lr=lr, mu=mu, fraction=fraction, fraction_warmup=warm,
                                horizon=horizon, seed=seed, fraction_allocation=allocation,
                                cost_rule="time" if allocation == "cost" else None, **common))
    runs = with_momentum_dtypes(runs, momentum_dtypes(args.momentum_dtype))
    return [dataclasses.replace(run, repeat=r) for run in runs for r in range(args.repeats)]


def plan_best_runs(args: argparse.Namespace, records: Sequence[dict]) -> list[Run]:
    """The best setting of each family (and of each Dion3 variant: fraction, warm-up, allocation)
    among `records` at horizon --best-at, compiled or not as --compile says, run again at
    --horizons with --seeds; every other field (lr, μ, batch, schedules, data) is the best run's
    own. Best: the lowest mean final validation loss over the seeds that every setting of the
    variant has (a seed-0 sweep whose winner then ran more seeds is judged on seed 0), or over
    each setting's own seeds when they share none. Families: --optimizers; Dion3 variants: those
    of --fraction, --fraction-warmup (in steps) and --fraction-allocation."""
    families = [f.strip() for f in args.optimizers.split(",") if f.strip()]
    fractions = set(_floats(args.fraction, "--fraction"))
    warmups = set(_ints(args.fraction_warmup, "--fraction-warmup"))
    allocations = {a.strip() for a in args.fraction_allocation.split(",") if a.strip()}
    by_setting: dict[tuple, tuple[Run, dict[int, float]]] = {}  # setting → (a run of it, loss per seed)
    for record in records:
        run = Run(**{**record["config"], "data": tuple(record["config"]["data"]) if record["config"]["data"] else None})
        if (run.model != args.model or run.horizon != args.best_at or run.optimizer not in families
                or run.compiled != args.compile or run.momentum_dtype is not None):  # best judged in float32
            continue
        if run.optimizer == "dion3" and (run.fraction not in fractions or run.fraction_warmup not in warmups
                                         or run.fraction_allocation not in allocations):
            continue
        if math.isfinite(record["final_val_loss"]) and not record.get("nonfinite_parameters"):
            by_setting.setdefault(run.setting, (run, {}))[1][run.seed] = record["final_val_loss"]
    variants: dict[tuple, list[tuple[Run, dict[int, float]]]] = {}
    for run, losses in by_setting.values():
        variants.setdefault((run.optimizer, run.fraction, run.fraction_warmup, run.fraction_allocation), []).append((run, losses))
    best: dict[tuple, tuple[float, Run]] = {}
    for variant, settings in variants.items():
        shared = set.intersection(*(set(losses) for _, losses in settings))
        scored = [(statistics.fmean(loss for seed, loss in losses.items() if not shared or seed in shared), run)
                  for run, losses in settings]
        best[variant] = min(scored, key=lambda item: item[0])
    if not best:
        raise SystemExit(f"quality_study: --best-from holds no finite {args.model} run at horizon {args.best_at} "
                         f"of {families} (and the Dion3 variants asked for)")
    horizons, seeds = sorted(set(_ints(args.horizons, "--horizons"))), _ints(args.seeds, "--seeds")
    ranked = sorted(best.values(), key=lambda item: item[0])
    for mean, run in ranked:
        print(f"best at {args.best_at} steps: {run.label.rsplit(' h=', 1)[0]} (mean {mean:.4f})", flush=True)
    best_runs = [dataclasses.replace(run, horizon=h, seed=s, repeat=0) for h in horizons for s in seeds for _, run in ranked]
    return with_momentum_dtypes(best_runs, momentum_dtypes(args.momentum_dtype))


# ----------------------------------------------------------------------------- one run (child process)
def build_llama(spec: ModelSpec):
    """A factory for the trainer: Hugging Face LlamaForCausalLM of `spec`'s shape, mapping
    (tokens, targets) to the mean loss, with its head exposed as `lm_head`."""
    import torch.nn.functional as F
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    class CausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.llama = LlamaForCausalLM(LlamaConfig(
                vocab_size=config.vocab_size, hidden_size=spec.d_model, intermediate_size=spec.mlp_width,
                num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head, num_key_value_heads=spec.kv_heads,
                max_position_embeddings=spec.seq_len, tie_word_embeddings=False, attn_implementation="sdpa",
            ))

        @property
        def lm_head(self):
            return self.llama.lm_head

        def forward(self, tokens, targets):
            logits = self.llama(input_ids=tokens).logits
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return CausalLM


def run_one(run: Run, device_name: str, threads: Optional[int]) -> dict:
    import torch

    from dion3.tools.train.corpus import python_source_corpus
    from dion3.tools.train.data import load_data
    from dion3.tools.train.model import GPT, GPTConfig
    from dion3.tools.train.trainer import RunSpec, Schedule, resolve_device, train

    if threads:
        torch.set_num_threads(threads)
    spec = MODELS[run.model]
    device = resolve_device(device_name)
    if run.data is None:
        data = python_source_corpus(progress=lambda line: print(line, flush=True))
    else:
        data = load_data(None if run.data == ("stdlib",) else list(run.data))
    config = GPTConfig(seq_len=spec.seq_len, n_layer=spec.n_layer, n_head=spec.n_head, d_model=spec.d_model)
    factory = GPT if spec.kind == "gpt" else build_llama(spec)
    schedule = Schedule(steps=run.horizon, batch_size=run.batch_size, eval_every=run.horizon, eval_batches=run.eval_batches,
                        warmup_steps=run.lr_warmup, cooldown_fraction=run.cooldown, read_once=run.read_once)
    # AdamW has no μ (its betas stay the defaults)
    run_spec = RunSpec(run.label, run.optimizer, run.lr, run.fraction, run.mu if run.optimizer != "adamw" else None,
                       run.fraction_warmup, run.fraction_allocation, run.momentum_dtype if run.optimizer != "adamw" else None)
    started = time.perf_counter()
    result = train(run_spec, config, schedule, data, device, run.seed, bf16=True, model_factory=factory, captured=run.captured,
                   compiled=run.compiled)
    return {
        "key": run.key, "config": dataclasses.asdict(run), "seed": run.seed, "horizon": run.horizon,
        "final_val_loss": result.final_val_loss,
        # the train/validation gap shows when a long horizon starts to overfit the repeated data
        "final_train_loss": statistics.fmean(result.train_losses[-50:]),
        "average_fraction": result.average_fraction if run.optimizer == "dion3" else 1.0,
        "optimizer_ms_median": result.optimizer_ms_median, "optimizer_ms_mean": result.optimizer_ms,
        "total_ms_mean": result.total_ms, "minutes": (time.perf_counter() - started) / 60,
        # executed orthogonalization FLOPs of all steps at each step's fractions, counted on the host with
        # `dion3 bench`'s H200 model (symmetric kernels from n ≥ SYMMETRIC_MIN_N, flops.h200_symmetric)
        # whatever the device: AdamW 0, Muon/NorMuon every row, Dion3 ⌈f·rows⌉ rows per matrix
        "optimizer_tflop": result.optimizer_flops / 1e12,
        "device": str(device), "torch": torch.__version__, "data": data.description,
        # the first step whose training loss was not finite (None: every step finite)
        "first_nonfinite_step": next((i for i, v in enumerate(result.train_losses) if not math.isfinite(v)), None),
        "nonfinite_updates": result.nonfinite_updates,
        "skipped_update_steps": result.skipped_update_steps,
        "nonfinite_parameters": result.nonfinite_parameters,
    }


# ----------------------------------------------------------------------------- the study (parent)
def read_results(path: Path) -> list[dict]:
    """Finished runs; a line cut short by a kill is ignored (the run is done again)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def pending(runs: Sequence[Run], results_path: Path) -> list[Run]:
    """The runs whose results are not in results_path yet, in plan order."""
    done = {record["key"] for record in read_results(results_path)}
    return [run for run in runs if run.key not in done]


def _launch(run: Run, device: str, threads: Optional[int], out: Path, jobs: int) -> subprocess.Popen:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "dion3.tools.study", "--run-one", json.dumps(dataclasses.asdict(run)),
               "--device", device, "--result", str(logs / f"{run.key}.json"), "--runs-at-once", str(jobs)]
    if threads:
        command += ["--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    with open(logs / f"{run.key}.log", "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_study(runs: Sequence[Run], out: Path, jobs: int, devices: Sequence[str], threads: Optional[int],
              stop_after: Optional[float]) -> int:
    """Run what is not in OUT/results.jsonl yet, `jobs` at a time; returns the number of failures."""
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    if results_path.exists() and not results_path.read_bytes().endswith(b"\n") and results_path.stat().st_size:
        with open(results_path, "a") as handle:  # a line cut short by a kill: end it, so the next one is whole
            handle.write("\n")
    todo = pending(runs, results_path)
    print(f"quality study: {len(runs)} runs, {len(runs) - len(todo)} already in {results_path}, {len(todo)} to run, "
          f"{jobs} at a time on {', '.join(devices)}", flush=True)
    started, failures, finished = time.perf_counter(), 0, 0
    running: dict = {}  # process → (run, start time)
    slot = itertools.count()
    try:
        while todo or running:
            late = stop_after is not None and time.perf_counter() - started > stop_after * 60
            while todo and len(running) < jobs and not late:
                run = todo.pop(0)
                device = devices[next(slot) % len(devices)]
                running[_launch(run, device, threads, out, jobs)] = (run, time.perf_counter())
                print(f"started {run.label} on {device}", flush=True)
            if late and todo:
                print(f"--stop-after {stop_after:g} min reached: {len(todo)} runs not started (run again to do them)", flush=True)
                todo = []
            for process in [p for p in running if p.poll() is not None]:
                run, begun = running.pop(process)
                result_file = out / "logs" / f"{run.key}.json"
                if process.returncode == 0 and result_file.exists():
                    record = json.loads(result_file.read_text())
                    with open(results_path, "a") as handle:
                        handle.write(json.dumps(record) + "\n")
                    finished += 1
                    fraction = record["average_fraction"]
                    print(f"[{finished + failures}/{finished + failures + len(todo) + len(running)}] {run.label}: "
                          f"val {record['final_val_loss']:.4f}, average fraction {fraction:.3f}, "
                          f"optimizer {record['optimizer_ms_median']:.2f} ms (median), {time.perf_counter() - begun:.0f} s", flush=True)
                else:
                    failures += 1
                    tail = (out / "logs" / f"{run.key}.log").read_text().splitlines()[-15:]
                    print(f"FAILED {run.label} (exit {process.returncode}); log {out / 'logs' / (run.key + '.log')}:\n  "
                          + "\n  ".join(tail), flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        for process in running:
            process.terminate()
        for process in running:
            process.wait()
        print(f"interrupted: {finished} runs finished and kept in {results_path}", flush=True)
        raise
    print(f"{finished} runs finished, {failures} failed, {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    return failures


def _setting_label(setting: tuple) -> tuple[str, str]:
    _, _, optimizer, fraction, warmup, _, _, allocation, _, _, cost_rule = setting
    if optimizer != "dion3":
        return {"adamw": "AdamW", "muon": "Muon", "normuon": "NorMuon"}[optimizer], "—"
    if allocation == "cost":
        return f"Dion3 f={fraction:g}", "by cost" if cost_rule else "by cost (FLOP rule)"
    return f"Dion3 f={fraction:g}", (f"1 → {fraction:g} over {warmup} steps" if warmup else "fixed")


def summary_table(records: Sequence[dict]) -> str:
    """Markdown: one row per setting and horizon, mean ± standard deviation over its seeds,
    best mean loss first within each horizon and model."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault(Run(**{**record["config"], "data": None}).setting, []).append(record)
    lines = [
        "| model | horizon | optimizer | fraction schedule | lr | μ | seeds | non-finite | skipped updates | final val loss "
        "| train loss, last 50 steps | average fraction | optimizer ms (median) | optimizer TFLOP / run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for setting, members in groups.items():
        # a non-finite run is a bug to explain, never a sample to average: counted apart
        finite = [m for m in members if math.isfinite(m["final_val_loss"]) and not m.get("nonfinite_parameters")]
        skipped = sum(m.get("nonfinite_updates", 0) for m in members)  # the optimizer's guard (rules.guard_rows)
        losses = [m["final_val_loss"] for m in finite]
        mean = statistics.fmean(losses) if losses else math.inf
        loss_text = f"{mean:.4f} ± {statistics.stdev(losses) if len(losses) > 1 else 0.0:.4f}" if losses else "—"
        train = [m["final_train_loss"] for m in finite if "final_train_loss" in m]  # absent in older records
        train_text = f"{statistics.fmean(train):.4f}" if train and len(train) == len(finite) else "—"
        flops = [m["optimizer_tflop"] for m in members if "optimizer_tflop" in m]  # absent in older records
        flops_text = f"{statistics.fmean(flops):.4g}" if flops and len(flops) == len(members) else "—"
        rows.append((setting[0], setting[1], mean, setting, len(members), len(members) - len(finite), skipped, loss_text, train_text,
                     statistics.fmean(m["average_fraction"] for m in members),
                     statistics.median(m["optimizer_ms_median"] for m in members), flops_text))
    for (model, horizon, _, setting, count, bad, skipped, loss_text, train_text, fraction, step_ms,
         flops_text) in sorted(rows, key=lambda r: r[:3]):
        name, schedule = _setting_label(setting)
        model = f"{model} (compiled)" if setting[8] else model
        name = f"{name}, {setting[9]} momentum" if setting[9] else name
        lines.append(f"| {model} | {horizon} | {name} | {schedule} | {setting[5]:g} | {setting[6]:g} | {count} | {bad} | {skipped} | "
                     f"{loss_text} | {train_text} | {fraction:.3f} | {step_ms:.2f} | {flops_text} |")
    return "\n".join(lines)


def _sharing_note(records: Sequence[dict]) -> str:
    """How many runs shared the device while the step times were measured, from the records (each
    run records its study's --jobs; records written before that field say nothing)."""
    counts = [r["runs_at_once"] for r in records if "runs_at_once" in r]
    if not counts:
        return "with an unrecorded number of runs sharing the device"
    unrecorded = len(records) - len(counts)
    return (f"with up to {max(counts)} runs of one study sharing the device"
            + (f" ({unrecorded} older records do not say how many)" if unrecorded else ""))


def write_summary(out: Path) -> str:
    records = read_results(out / "results.jsonl")
    table = summary_table(records)
    note = (f"Final validation loss (nats per byte), mean ± standard deviation over seeds; optimizer step "
            f"time: median over each run's steps after the first 5, median over seeds, measured "
            f"{_sharing_note(records)}; optimizer TFLOP: executed orthogonalization FLOPs of a run's steps "
            f"(mean over seeds; H200 cost model of `dion3 bench`). {len(records)} runs in results.jsonl.")
    repeated = sum(1 for r in records if not r["config"].get("read_once", False))
    if repeated:
        note += (f"\n\n**{repeated} runs drew random windows that may read data more than once** (--allow-repeat, or "
                 "records from before read-once data): their losses include memorization.")
    (out / "summary.md").write_text(f"# Quality study\n\n{note}\n\n{table}\n")
    return table


# ----------------------------------------------------------------------------- command line
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-25m", choices=sorted(MODELS))
    parser.add_argument("--horizons", default="400,1500,4000", help="training steps per run, comma-separated")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--optimizers", default=",".join(FAMILIES), help="families to run (default: %(default)s)")
    for family, (lr, mu) in FAMILIES.items():
        parser.add_argument(f"--{family}-lr", default=lr, help=f"{family} matrix learning rates (default {lr})")
        if mu:
            parser.add_argument(f"--{family}-mu", default=mu, help=f"{family} momenta (default {mu})")
    parser.add_argument("--fraction", default="0.25",
                        help="Dion3's (final) fractions, comma-separated (with --fraction-allocation cost: the uniform "
                             "fraction whose orthogonalization FLOPs the per-shape fractions share)")
    parser.add_argument("--fraction-warmup", default="0,200",
                        help="Dion3 fraction warm-ups from 1, comma-separated: steps, or P%% of the horizon; 0 = fixed fraction")
    parser.add_argument("--fraction-allocation", default="uniform",
                        help="Dion3 fractions, comma-separated: uniform (--fraction on every matrix) and/or cost (per "
                             "matrix shape, by orthogonalization cost at the same FLOPs; needs --fraction-warmup 0)")
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
