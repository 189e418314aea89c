#!/usr/bin/env bash
# One GPU job = the stages named as arguments, run in order. Each stage writes its files into a fresh
# temporary folder; at the end that folder is packed into $OUT/results.tgz, with OUT taken from the
# environment (default /tmp/dion3-out, created if missing), plus env.txt with the torch/Triton versions.
#   bash benchmarks/run_h200.sh check step cold      # GPU tests, step-time tables, cold first step
#   bash benchmarks/run_h200.sh train dist            # gpu-small comparison, NCCL distributed script
#   bash benchmarks/run_h200.sh kernels sweep         # dion3 bench kernels; variant sweep (VARIANTS=a,b,c: which ones,
#                                                       SHAPES=x,y: only timed shapes whose label contains x or y,
#                                                       NO_TESTS=1: no kernel tests in the background)
#   bash benchmarks/run_h200.sh ab ab-narrow          # whole steps with the Hopper Gluon kernel off/on; with its 128×128 tiles off/on
#   bash benchmarks/run_h200.sh quick elementwise profile   # headline step rows; memory-bound kernels' block sizes; per-kernel profile
# Stages, commands and the results files they produce: benchmarks/README.md.
set -uo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
FINAL=${OUT:-/tmp/dion3-out}; mkdir -p "$FINAL"; OUT=$(mktemp -d)  # stages write into $OUT; packed into $FINAL/results.tgz at the end
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
run() { echo "== $*"; local t=$SECONDS; "$@"; echo "== rc=$? in $((SECONDS - t)) s"; }
dion3() { python3 -m dion3.tools.cli "$@"; }
for stage in "$@"; do
  case "$stage" in
    check) run python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu-tests.txt" ;;
    step)
      run dion3 bench --preset llama-1b --steps 20 --json "$OUT/step-llama-1b.json" 2>&1 | tee "$OUT/step-llama-1b.txt"
      run dion3 bench --preset llama-8b --skip adamw --steps 10 --warmup 4 --json "$OUT/step-llama-8b.json" 2>&1 | tee "$OUT/step-llama-8b.txt" ;;
    quick)  # the headline rows only: baseline and Dion3, both presets
      run python3 -m pytest -q -m gpu tests/test_elementwise_kernels.py tests/test_graph.py 2>&1 | tee "$OUT/gpu-tests-quick.txt"
      run dion3 bench --preset llama-8b --optimizers muon,muon-gram,dion3-1/4 --steps 10 --warmup 4 --json "$OUT/step-llama-8b-quick.json" 2>&1 | tee "$OUT/step-llama-8b-quick.txt"
      run dion3 bench --preset llama-1b --optimizers muon,muon-gram,dion3-1/4 --steps 20 --json "$OUT/step-llama-1b-quick.json" 2>&1 | tee "$OUT/step-llama-1b-quick.txt" ;;
    kernels)  # what the optimizer runs: the kernel-target table of kernels-h200-2026-11-29.md
      run dion3 bench kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt" ;;
    sweep)  # symmetric-kernel variants, each checked against float64 first
      n=$(ls -d "$OUT"/sweep*/ 2>/dev/null | wc -l); dir="$OUT/sweep$n"  # a repeated stage keeps both runs
      mkdir -p "$dir" && OUT="$dir" run timeout 330 python3 benchmarks/sweep_symmetric.py --only ${VARIANTS:-gluon,narrow4,narrow5,reg128} \
        ${SHAPES:+--shapes "$SHAPES"} $( { [ "$n" -gt 0 ] || [ -n "${NO_TESTS:-}" ]; } && echo --no-tests) 2>&1 | tail -20 | tee "$dir.txt" ;;
    ab)  # whole steps with the Hopper kernel off (0) and on (1), alternating
      for flag in 0 1; do
        DION3_HOPPER_KERNEL=$flag run timeout 150 python3 -m dion3.tools.cli bench --preset llama-8b --optimizers dion3-1/4,muon-gram --steps 10 --warmup 4 --json "$OUT/step-llama-8b-hopper$flag.json" 2>&1 | tail -8 | tee "$OUT/step-llama-8b-hopper$flag.txt"
        DION3_HOPPER_KERNEL=$flag run timeout 90 python3 -m dion3.tools.cli bench --preset llama-1b --optimizers dion3-1/4 --steps 20 --json "$OUT/step-llama-1b-hopper$flag.json" 2>&1 | tail -6 | tee "$OUT/step-llama-1b-hopper$flag.txt"
      done ;;
    ab-narrow)  # whole steps with the Hopper kernel's 128×128 tiles off (wide tiles and the Triton kernel only), then on
      for narrow in off on; do
        for preset in llama-8b:10 llama-1b:20; do
          run timeout 200 python3 -c "import sys; from dion3.tools import cli; from dion3.kernels import hopper_tiling as h
h.NARROW_MIN_BLOCK = 1 << 30 if '$narrow' == 'off' else h.NARROW_MIN_BLOCK
sys.exit(cli.main(['bench', '--preset', '${preset%%:*}', '--optimizers', 'muon,muon-gram,dion3-1/4', '--steps', '${preset#*:}', '--warmup', '4', '--json', '$OUT/step-${preset%%:*}-narrow-$narrow.json']))" 2>&1 | tail -7 | tee "$OUT/step-${preset%%:*}-narrow-$narrow.txt"
        done
      done ;;
    elementwise)  # block sizes of the memory-bound kernels
      OUT="$OUT" run timeout 420 python3 benchmarks/sweep_elementwise.py 2>&1 | tee "$OUT/sweep-elementwise.txt" ;;
    cold)
      TRITON_CACHE_DIR=$(mktemp -d) run dion3 bench --preset llama-8b --optimizers dion3-1/4 --steps 10 --warmup 4 \
        --json "$OUT/step-llama-8b-cold.json" 2>&1 | tee "$OUT/step-llama-8b-cold.txt" ;;
    train) run timeout 420 python3 -m dion3.tools.cli compare --preset gpu-small --out "$OUT/compare-gpu-small" 2>&1 | tail -40 | tee "$OUT/compare-gpu-small.txt" ;;
    profile)
      for pv in llama-8b:dion3-1/4 llama-8b:muon-gram llama-1b:dion3-1/4; do
        run python3 benchmarks/profile_step.py --preset "${pv%%:*}" --optimizer "${pv#*:}" 2>&1 | tee -a "$OUT/profile.txt"
      done ;;
    dist) run timeout 300 python3 -m torch.distributed.run --nproc_per_node="${NPROC:-1}" benchmarks/distributed_step.py --out "$OUT/dist" 2>&1 | tail -60 | tee "$OUT/dist.txt" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
tar czf "$FINAL/results.tgz" -C "$OUT" . && ls -la "$OUT"
