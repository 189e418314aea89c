#!/usr/bin/env bash
# Which component the non-finite orthogonalizations need: the reported setting's short runs
# (traced, every operation inside Newton–Schulz recorded and audited) in arms that each take one
# component away, run side by side on one GPU.
#
#   benchmarks/nonfinite_arms.sh OUTDIR [RUNS_PER_ARM] [MINUTES] [ARMS]
#
# ARMS (comma-separated, default all): default, no_hopper (DION3_HOPPER_KERNEL=0: Triton
# kernels only), no_kernels (DION3_KERNELS=0: PyTorch/cuBLAS only), full_reduction (cuBLAS half
# products with full-precision reductions); also launch_blocking (CUDA_LAUNCH_BLOCKING=1: every
# kernel waits for the one before to finish and for the host: a fault of timing between kernels
# disappears). Each arm's runs use the same seeds.
set -u
out=${1:?OUTDIR}; runs=${2:-64}; minutes=${3:-6}; arms=${4:-default,no_hopper,no_kernels,full_reduction}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
python -c "import sys; sys.path.insert(0, '$here/../src'); from dion3.train.corpus import python_source_corpus; python_source_corpus()"
count=$(echo "$arms" | tr ',' '\n' | grep -c .)
jobs=$(( 24 / count )); [ "$jobs" -lt 4 ] && jobs=4
for arm in $(echo "$arms" | tr ',' ' '); do
  case $arm in
    default) env_arm="";;
    no_hopper) env_arm="DION3_HOPPER_KERNEL=0";;
    no_kernels) env_arm="DION3_KERNELS=0";;
    full_reduction) env_arm="DION3_TRACE_FULL_FP16_REDUCTION=1";;
    launch_blocking) env_arm="CUDA_LAUNCH_BLOCKING=1";;
    *) echo "unknown arm $arm" >&2; exit 2;;
  esac
  env DION3_TRACE_OPS=1 $env_arm python "$here/quality_study.py" --model llama-384 --optimizers dion3 \
    --dion3-lr 0.06 --dion3-mu 0.6 --fraction-warmup 200 --horizons 36 --seeds "$(seq -s, 300 $((299 + runs)))" \
    --lr-warmup 50 --cooldown 0.3 --eval-batches 2 --jobs "$jobs" --stop-after "$minutes" \
    --out "$out/$arm" --trace "$out/$arm/trace" > "$out/$arm.log" 2>&1 &
done
wait
for arm in $(echo "$arms" | tr ',' ' '); do
  finished=$(grep -c . "$out/$arm/results.jsonl" 2>/dev/null || echo 0)
  bad_runs=$(grep -l nonfinite_step "$out/$arm/trace/"*.jsonl 2>/dev/null | wc -l)
  echo "== $arm: $finished runs finished, $(grep -c FAILED "$out/$arm.log") failed, $bad_runs with a bad orthogonalization"
  grep -h op_trace_call "$out/$arm/trace/"*.jsonl 2>/dev/null | head -n 3 | cut -c1-2500
done
