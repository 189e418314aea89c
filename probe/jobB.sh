export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; git log --oneline -1 2>/dev/null
echo "== gpu tests"; timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_selection_kernels.py tests/test_nonfinite_guard.py tests/test_guard_kernels.py tests/test_graph.py 2>&1 | tail -4
echo "== A/B llama-384 eager"
for r in 1 2; do P=""; [ $r = 1 ] && P=--profile; for side in base new; do S=src; [ $side = base ] && S=probe/base_src; PYTHONPATH=$S timeout 100 python probe/diag.py --tag $side --out $OUT/ab384-$side$r.json $P 2>&1 | grep "^$side"; done; done
echo "== A/B 1b, 8b"
for side in base new; do S=src; [ $side = base ] && S=probe/base_src; PYTHONPATH=$S timeout 80 python probe/diag.py --tag $side --shape 1b --optimizers dion3-1/4,muon-gram 2>&1 | grep "^$side"; PYTHONPATH=$S timeout 80 python probe/diag.py --tag $side --shape 8b --optimizers dion3-1/4 2>&1 | grep "^$side"; done
echo "== frontier bench"
for p in llama-8b llama-1b; do PYTHONPATH=src timeout 150 python -m dion3.tools.cli bench --preset $p --optimizers muon-gram,normuon,dion3-1/4-cost,dion3-3/8-cost,dion3-1/2-cost --steps 10 --json $OUT/bench-$p.json 2>/dev/null | tail -12; done
