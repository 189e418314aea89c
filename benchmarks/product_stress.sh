#!/usr/bin/env bash
# Gram Newton–Schulz's products repeated on fixed operands (benchmarks/product_stress.py), first
# by one process alone on the GPU, then by many processes sharing it (the conditions of the
# non-finite runs), then shared without dion3's kernels. A count of results that differ from the
# first one, per operation and k, per arm.
#
#   bash benchmarks/product_stress.sh OUTDIR [CROWD] [SECONDS] [ROWS]
#
# CROWD processes share the GPU in the shared arms (default 16); SECONDS per arm (default 90;
# the alone arm gets the same); ROWS the k values (default 967,928,909,960,1024).
set -u
out=${1:?OUTDIR}; crowd=${2:-16}; seconds=${3:-90}; rows=${4:-967,928,909,960,1024}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
arm() {  # arm NAME PROCESSES [ENV...]
  local name=$1 procs=$2; shift 2
  mkdir -p "$out/$name"
  for i in $(seq 1 "$procs"); do
    env "$@" python "$here/product_stress.py" --rows "$rows" --seconds "$seconds" --seed "$i" \
      --tag "$name" --out "$out/$name/p$i.json" > "$out/$name/p$i.log" 2>&1 &
  done
  wait
  python - "$out/$name" <<'PY'
import glob, json, sys
from collections import defaultdict
tot = defaultdict(lambda: [0, 0, 0, 0.0])
for path in sorted(glob.glob(sys.argv[1] + "/p*.json")):
    for c in json.load(open(path))["cases"]:
        t = tot[(c["op"], c["k"])]
        t[0] += c["matrices"]; t[1] += c["differ"]; t[2] += c["nonfinite"]; t[3] = max(t[3], c["max_diff"])
print(f"== {sys.argv[1].rsplit('/', 1)[-1]}: {len(glob.glob(sys.argv[1] + '/p*.json'))} processes reported")
for (op, k), (m, d, nf, md) in sorted(tot.items()):
    print(f"  {op:13s} k={k:5d} matrices {m:9d} differing {d:6d} non-finite {nf:5d} max |diff| {md:.3g}")
PY
}
arm alone 1
arm crowd "$crowd"
arm crowd_no_kernels "$crowd" DION3_KERNELS=0
