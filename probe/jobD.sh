export PYTHONUNBUFFERED=1 PYTHONPATH=src
echo "== gpu tests"; timeout 100 python -m pytest -q -m gpu -p no:cacheprovider tests/test_selection_kernels.py tests/test_nonfinite_guard.py tests/test_guard_kernels.py 2>&1 | tail -3
echo "== A/B llama-384 eager"
for r in 1 2; do for side in new base; do S=src; [ $side = base ] && S=probe/base_src; PYTHONPATH=$S timeout 40 python probe/diag.py --tag $side --out $OUT/ab384-$side$r.json 2>&1 | grep "^$side"; done; done
