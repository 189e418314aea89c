#!/usr/bin/env bash
# Kernel sweep on GPU 0 while GPU 1 times the NS/Gram method choice and the Llama-8B step
# (one nvidia-h200-x2 call, 2026-11-29 second session). Results under $OUT.
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L > "$OUT/gpus.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$OUT/gpus.txt"
mkdir -p "$OUT/sweep"
(CUDA_VISIBLE_DEVICES=0 OUT="$OUT/sweep" timeout 340 python3 benchmarks/sweep_symmetric.py > "$OUT/sweep.log" 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 220 python3 benchmarks/method_choice.py --json "$OUT/method_choice.json" > "$OUT/method.log" 2>&1
 CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m dion3.cli bench --preset llama-8b --optimizers muon,dion3-1/4,dion3-1/8 \
   --steps 10 --warmup 4 --json "$OUT/step-llama-8b.json" > "$OUT/step-llama-8b.log" 2>&1) &
wait
tail -30 "$OUT/sweep.log"; cat "$OUT/method.log"; tail -15 "$OUT/step-llama-8b.log"
