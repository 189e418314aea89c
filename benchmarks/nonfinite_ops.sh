#!/usr/bin/env bash
# Short eager runs of the reported setting with every operation inside Newton–Schulz recorded
# (nonfinite_trace.py with DION3_TRACE_OPS=1): for each bad orthogonalization, the first
# operation whose output went bad, and that operation run again on its recorded operands.
#
#   benchmarks/nonfinite_ops.sh OUTDIR [RUNS] [MINUTES] [JOBS]
set -u
out=${1:?OUTDIR}; runs=${2:-42}; minutes=${3:-2.5}; jobs=${4:-14}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
python -c "import sys; sys.path.insert(0, '$here/../src'); from dion3.train.corpus import python_source_corpus; python_source_corpus()"
DION3_TRACE_OPS=1 python "$here/quality_study.py" --model llama-384 --optimizers dion3 --dion3-lr 0.06 --dion3-mu 0.6 \
  --fraction-warmup 200 --horizons 36 --seeds "$(seq -s, 200 $((199 + runs)))" --lr-warmup 50 --cooldown 0.3 \
  --eval-batches 2 --jobs "$jobs" --stop-after "$minutes" --out "$out/ops" --trace "$out/ops/trace" > "$out/ops.log" 2>&1
echo "== $(grep -c . "$out/ops/results.jsonl" 2>/dev/null || echo 0) runs finished; $(grep -c FAILED "$out/ops.log") failed"
grep -h "nonfinite_step\|op_trace_call" "$out/ops/trace/"*.jsonl 2>/dev/null | cut -c1-3000
