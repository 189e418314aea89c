#!/usr/bin/env bash
# Gram Newton–Schulz's products repeated on fixed operands (benchmarks/product_stress.py), first
# by one process alone on the GPU, then by many processes sharing it (the conditions of the
# non-finite runs), then shared without dion3's kernels. A count of results that differ from the
# first one, per operation and k, per arm.
#
#   bash benchmarks/product_stress.sh OUTDIR [CROWD] [SECONDS] [ROWS]
#
# CROWD processes share the GPU in the shared arms (default 16); SECONDS per arm (default 90;
# the alone arm gets the same); ROWS the k values (default 967,928,909,960,1024); ARMS a comma
# list (default alone,crowd,crowd_no_kernels), also: crowd_chains (the chains of dependent
# kernels with and without dion3: ortho, ns_torch, add_chain), crowd_blocking (the same with
# CUDA_LAUNCH_BLOCKING=1), victim (one process runs the chains while CROWD-1 others only load
# the GPU with large products).
set -u
out=${1:?OUTDIR}; crowd=${2:-16}; seconds=${3:-90}; rows=${4:-967,928,909,960,1024}
arms=${5:-alone,crowd,crowd_no_kernels}
chains=ortho,ns_torch,add_chain
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
launch() {  # launch NAME INDEX OPS [ENV...]
  local name=$1 i=$2 ops=$3; shift 3
  env "$@" python "$here/product_stress.py" --rows "$rows" --seconds "$seconds" --seed "$i" --ops "$ops" \
    --tag "$name" --out "$out/$name/p$i.json" > "$out/$name/p$i.log" 2>&1 &
}
arm() {  # arm NAME PROCESSES OPS [ENV...]: every process runs OPS
  local name=$1 procs=$2 ops=$3; shift 3
  mkdir -p "$out/$name"
  for i in $(seq 1 "$procs"); do launch "$name" "$i" "$ops" "$@"; done
  wait
  report "$name"
}
report() {
  local name=$1
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
ops=restart,final,final_padded,gram,ortho
for a in $(echo "$arms" | tr ',' ' '); do
  case $a in
    alone) arm alone 1 "$ops";;
    crowd) arm crowd "$crowd" "$ops";;
    crowd_no_kernels) arm crowd_no_kernels "$crowd" "$ops" DION3_KERNELS=0;;
    crowd_chains) arm crowd_chains "$crowd" "$chains";;
    crowd_blocking) arm crowd_blocking "$crowd" "$chains" CUDA_LAUNCH_BLOCKING=1;;
    victim)
      mkdir -p "$out/victim"
      launch victim 1 "$chains"
      for i in $(seq 2 "$crowd"); do launch victim "$i" burn; done
      wait
      report victim;;
    *) echo "unknown arm $a" >&2; exit 2;;
  esac
done
