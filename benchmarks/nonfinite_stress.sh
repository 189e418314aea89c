#!/usr/bin/env bash
# Many short runs of one Dion3 schedule at once on one GPU, eager and through CapturedStep,
# every step traced (nonfinite_trace.py: one host sync per step, none inside it); then each
# kept orthogonalization is replayed and explained on the same GPU (replay_step.py).
#
#   benchmarks/nonfinite_stress.sh OUTDIR [RUNS] [STEPS] [MINUTES] [extra quality_study flags...]
#
# Defaults: 64 runs per arm (seeds 0..RUNS-1), 36 steps, the reported setting (llama-384,
# lr 0.06, μ 0.6, f 1 → ¼ over 200 steps, lr warm-up 50), arms started for at most MINUTES.
set -u
out=${1:?OUTDIR}; runs=${2:-64}; steps=${3:-36}; minutes=${4:-5}; shift $(( $# < 4 ? $# : 4 ))
here=$(cd "$(dirname "$0")" && pwd)
seeds=$(seq -s, 0 $((runs - 1)))
mkdir -p "$out"
# build (or find) the cached corpus once, before the runs that read it
python -c "import sys; sys.path.insert(0, '$here/../src'); from dion3.train.corpus import python_source_corpus; python_source_corpus(progress=print)"
for arm in eager captured; do
  flag=""; [ "$arm" = captured ] && flag="--captured"
  python "$here/quality_study.py" --model llama-384 --optimizers dion3 --dion3-lr 0.06 --dion3-mu 0.6 \
    --fraction-warmup 200 --horizons "$steps" --seeds "$seeds" --lr-warmup 50 --cooldown 0.3 --eval-batches 2 \
    --jobs 16 --stop-after "$minutes" $flag --out "$out/$arm" --trace "$out/$arm/trace" "$@" > "$out/$arm.log" 2>&1 &
done
wait
for arm in eager captured; do
  echo "== $arm: $(grep -c . "$out/$arm/results.jsonl" 2>/dev/null || echo 0) runs"
  grep -h nonfinite_step "$out/$arm/trace/"*.jsonl 2>/dev/null | cut -c1-600
  for dump in "$out/$arm/trace/"*-[0-9]*.pt; do
    [ -e "$dump" ] || continue
    echo "-- $dump"
    python "$here/replay_step.py" "$dump" --device cuda
    python "$here/replay_step.py" "$dump" --device cuda --explain
    python "$here/replay_step.py" "$dump" --device cuda --dtype float64
  done
done
