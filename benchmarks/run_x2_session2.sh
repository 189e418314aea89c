#!/usr/bin/env bash
# Second-session runs on nvidia-h200-x2 (2026-11-29). Results under $OUT.
#   bash benchmarks/run_x2_session2.sh kernels   # kernel sweep (GPU 0) ∥ method choice + 8B quick step (GPU 1)
#   bash benchmarks/run_x2_session2.sh step      # GPU tests + kernel sweep (GPU 0) ∥ full 8B and 1B step tables (GPU 1)
#   bash benchmarks/run_x2_session2.sh dist      # FSDP2 on both GPUs: equivalence + step table, Llama-1B and Llama-8B
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L > "$OUT/gpus.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$OUT/gpus.txt"
bench() { python3 -m dion3.cli bench "$@"; }
case "${1:-}" in
  kernels)
    mkdir -p "$OUT/sweep"
    (CUDA_VISIBLE_DEVICES=0 OUT="$OUT/sweep" timeout 340 python3 benchmarks/sweep_symmetric.py > "$OUT/sweep.log" 2>&1) &
    (CUDA_VISIBLE_DEVICES=1 timeout 220 python3 benchmarks/method_choice.py --json "$OUT/method_choice.json" > "$OUT/method.log" 2>&1
     CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m dion3.cli bench --preset llama-8b --optimizers muon,dion3-1/4,dion3-1/8 \
       --steps 10 --warmup 4 --json "$OUT/step-llama-8b.json" > "$OUT/step-llama-8b.log" 2>&1) &
    wait
    tail -30 "$OUT/sweep.log"; cat "$OUT/method.log"; tail -15 "$OUT/step-llama-8b.log" ;;
  step)
    mkdir -p "$OUT/sweep"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 200 python3 -m pytest -q -m gpu tests -p no:cacheprovider > "$OUT/gpu-tests.txt" 2>&1
     OUT="$OUT/sweep" timeout 150 python3 benchmarks/sweep_symmetric.py > "$OUT/sweep.log" 2>&1) &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 250 python3 -m dion3.cli bench --preset llama-8b --skip adamw --steps 10 --warmup 4 --json "$OUT/step-llama-8b.json" > "$OUT/step-llama-8b.log" 2>&1
     timeout 120 python3 -m dion3.cli bench --preset llama-1b --steps 20 --json "$OUT/step-llama-1b.json" > "$OUT/step-llama-1b.log" 2>&1) &
    wait
    tail -3 "$OUT/gpu-tests.txt"; tail -16 "$OUT/sweep.log"; tail -12 "$OUT/step-llama-8b.log"; tail -12 "$OUT/step-llama-1b.log" ;;
  dist)
    for preset in llama-1b llama-8b; do
      timeout 270 python3 -m torch.distributed.run --nproc_per_node=2 benchmarks/distributed_step.py \
        --preset "$preset" --out "$OUT/dist-$preset" > "$OUT/dist-$preset.log" 2>&1
      echo "== $preset rc=$?"; tail -32 "$OUT/dist-$preset.log"
    done ;;
  *) echo "stage: kernels | step | dist"; exit 2 ;;
esac
