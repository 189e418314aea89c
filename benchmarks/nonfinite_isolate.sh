#!/usr/bin/env bash
# Narrow down a non-finite orthogonalization on one GPU, in one job:
#  1. fill_nan_sweep.py: every k of the tall gate/up selections (896-1024 × 384, batch 24),
#     each product's output NaN-filled before the kernels write it;
#  2. four runs of the reported setting with every new tensor NaN-filled (DION3_TRACE_FILL_NAN);
#  3. RUNS short eager runs, traced, keeping the whole batch of each bad call; then each kept
#     batch replayed 10 times as recorded, with NaN-filled memory, on the Triton kernel alone
#     (DION3_HOPPER_KERNEL=0) and without kernels (DION3_KERNELS=0).
#
#   benchmarks/nonfinite_isolate.sh OUTDIR [RUNS] [MINUTES]
set -u
out=${1:?OUTDIR}; runs=${2:-48}; minutes=${3:-3.5}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
python -c "import sys; sys.path.insert(0, '$here/../src'); from dion3.train.corpus import python_source_corpus; python_source_corpus(progress=print)"
study() {  # arm jobs seeds [env...]
  local arm=$1 jobs=$2 seeds=$3; shift 3
  env "$@" python "$here/quality_study.py" --model llama-384 --optimizers dion3 --dion3-lr 0.06 --dion3-mu 0.6 \
    --fraction-warmup 200 --horizons 36 --seeds "$seeds" --lr-warmup 50 --cooldown 0.3 --eval-batches 2 \
    --jobs "$jobs" --stop-after "$minutes" --out "$out/$arm" --trace "$out/$arm/trace" > "$out/$arm.log" 2>&1
}
python "$here/fill_nan_sweep.py" --rows 896-1024 --cols 384 --batch 24 > "$out/sweep.log" 2>&1 &
study fillnan 4 0,1,2,3 DION3_TRACE_FILL_NAN=1 &
study eager 18 "$(seq -s, 100 $((99 + runs)))" DION3_TRACE_KEEP_BATCH=1 &
wait
echo "== sweep"; tail -n 20 "$out/sweep.log"
for arm in fillnan eager; do
  echo "== $arm: $(grep -c . "$out/$arm/results.jsonl" 2>/dev/null || echo 0) runs finished; $(grep -c FAILED "$out/$arm.log") failed"
  grep -h nonfinite_step "$out/$arm/trace/"*.jsonl 2>/dev/null | cut -c1-400
done
for batch in $(ls "$out"/eager/trace/*-batch.pt 2>/dev/null | head -n 2); do
  [ -e "$batch" ] || continue
  echo "-- $batch"
  for setting in "" "--fill-nan"; do
    python "$here/replay_step.py" "$batch" --device cuda --explain --repeats 10 $setting | grep -v product_max_abs | sed "s/^/[recorded $setting] /"
  done
  DION3_HOPPER_KERNEL=0 python "$here/replay_step.py" "$batch" --device cuda --explain --repeats 10 --fill-nan | grep bad_matrices | sed "s/^/[triton only] /"
  DION3_KERNELS=0 python "$here/replay_step.py" "$batch" --device cuda --explain --repeats 10 --fill-nan | grep bad_matrices | sed "s/^/[no kernels] /"
done
rm -f "$out"/eager/trace/*-batch.pt
