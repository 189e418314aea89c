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
cost within the modeled step time of the uniform --fraction (dion3.optim.cost_fractions); with a
--fraction-warmup that budget warms up from 1 (labelled -cost-warmupN). Records from before 2026-12-03 allocated by executed FLOPs instead: their
config has no `cost_rule`, and they are labelled `-cost-flops`. Every record carries `optimizer_tflop`, the executed orthogonalization FLOPs of
its steps, so settings can be compared at equal optimizer FLOPs as well as at equal steps.

`--ns-coefficients polar_express,polar_express_4` runs every Muon, NorMuon and Dion3 setting once
per Newton–Schulz schedule (names of dion3.ortho.SCHEDULES; polar_express_4 and polar_express_3
take 4 and 3 steps). Runs of the default schedule keep their keys; the others are their own
settings, labelled with their step count ("Dion3, 4 NS steps") in the summary, frontier and regime.

`--unselected-decay 1,0.9` and `--full-every 0,8` run every Dion3 setting once per decay of the rows
a step does not select (Dion3's unselected_decay) and once per period of full steps (every row on
every K-th step, dion3.PeriodicFull; 0: never). Runs of the rule (1, 0) keep their keys; the others
are their own settings ("-unselected0.9", "-full-every8").
"""
from __future__ import annotations

import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parents[3]
if _SRC.is_dir() and str(_SRC) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(_SRC))

from .child import build_llama, run_one  # noqa: E402
from .cli import main, parse_args  # noqa: E402
from .launch import pending, read_results, run_study  # noqa: E402
from .runs import FAMILIES, MODELS, ModelSpec, Run, plan_best_runs, plan_runs  # noqa: E402
from .summary import summary_table, write_summary  # noqa: E402

__all__ = ["FAMILIES", "MODELS", "ModelSpec", "Run", "build_llama", "main", "parse_args", "pending", "plan_best_runs",
           "plan_runs", "read_results", "run_one", "run_study", "summary_table", "write_summary"]
