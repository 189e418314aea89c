#!/usr/bin/env bash
# Dion3 f=1/4 under FSDP2 at one rank, Llama-8B shapes, global and local selection: two library
# trees timed against each other on one GPU, in the order old, new, new, old (each tree twice,
# a drift over the job cancels in the means). Every run is one process of
# benchmarks/distributed_step.py (this checkout's driver; the library comes from the tree given)
# with both variants, --warmup 3 --steps 15 (median step time), after its equivalence check.
#
#   bash benchmarks/ab_global_selection.sh OLD_SRC NEW_SRC OUTDIR
#
# OLD_SRC, NEW_SRC: folders holding the dion3 package (a checkout's src/, or the checkout itself).
# OUTDIR gets one JSON per run (run1-old.json, run2-new.json, run3-new.json, run4-old.json: the
# driver's report) and summary.md (step times per run and the mean new/old ratio per variant).
# An old tree from git, beside this checkout's src as the new one (runs/ is ignored by git):
#   mkdir -p runs/ab-old && git archive REV src | tar -x -C runs/ab-old
#   bash benchmarks/ab_global_selection.sh runs/ab-old/src src "$OUT/ab"
# SHAPES=64x48:4 (say) times those matrices instead of the preset: a smoke run on a CPU (gloo;
# there the driver's 1e-5 equivalence bound can fail and the script then exits 1, reports kept).
# Expected 30-40 s a run on an H200 from earlier runs' step and first-step times (every run
# allocates the 7B fp32 parameters, gradients and momentum; the first also compiles the Triton
# kernels); each run is stopped after 110 s.
set -uo pipefail
if [ $# -ne 3 ]; then
  echo "usage: $0 OLD_SRC NEW_SRC OUTDIR" >&2
  exit 2
fi
tree() {  # the folder that holds dion3/, absolute
  local dir=$1
  [ -d "$dir/src/dion3" ] && dir="$dir/src"
  [ -f "$dir/dion3/__init__.py" ] || { echo "no dion3 package under $1" >&2; exit 2; }
  (cd "$dir" && pwd)
}
OLD=$(tree "$1") || exit 2
NEW=$(tree "$2") || exit 2
OUTDIR=$3
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
DRIVER="$(cd "$(dirname "$0")" && pwd)/distributed_step.py"
WORK=$(mktemp -d)  # the driver's own folder per run (its .md files stay here: few files come back)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
STEPS=15
WARMUP=3
VARIANTS="dion3-1/4 global,dion3-1/4 local"
MATRICES=(--preset llama-8b)
[ -n "${SHAPES:-}" ] && MATRICES=(--shapes "$SHAPES")

failed=0
for entry in 1:old 2:new 3:new 4:old; do
  run=${entry%%:*}
  side=${entry#*:}
  src=$([ "$side" = old ] && echo "$OLD" || echo "$NEW")
  found=$(PYTHONPATH="$src" python3 -c 'import dion3, os; print(os.path.dirname(os.path.dirname(dion3.__file__)))')
  if [ "$found" != "$src" ]; then  # an installed dion3 must not stand in for the tree under test
    echo "run $run ($side): dion3 imports from $found, not $src" >&2
    exit 1
  fi
  echo "== run $run: $side ($src)"
  began=$SECONDS
  log="$WORK/run$run-$side.log"
  PYTHONPATH="$src" timeout 110 python3 -m torch.distributed.run --standalone --nproc_per_node=1 "$DRIVER" \
    "${MATRICES[@]}" --variants "$VARIANTS" --warmup "$WARMUP" --steps "$STEPS" --out "$WORK/run$run-$side" >"$log" 2>&1
  rc=$?
  grep -E " ms  first |MISMATCH|FAILED" "$log"
  if [ -f "$WORK/run$run-$side/distributed_step.json" ]; then
    cp "$WORK/run$run-$side/distributed_step.json" "$OUTDIR/run$run-$side.json"
  else  # no report: the run broke (or timed out, rc 124)
    tail -30 "$log"
  fi
  echo "== run $run: rc=$rc in $((SECONDS - began)) s"
  [ "$rc" -eq 0 ] || failed=1  # 1 with a report: an equivalence check failed
done

python3 - "$OUTDIR" "$OLD" "$NEW" "$STEPS" "$WARMUP" <<'EOF'
import glob, hashlib, json, os, statistics, sys

outdir, old, new, steps, warmup = sys.argv[1:]


def digest(root):  # which library was timed: a hash of its Python sources
    h = hashlib.sha1()
    for path in sorted(glob.glob(os.path.join(root, "dion3", "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


runs = []
for path in sorted(glob.glob(os.path.join(outdir, "run*-*.json"))):
    name = os.path.basename(path)[:-5]
    with open(path) as f:
        report = json.load(f)
    ok = all(c["ok"] for c in report["equivalence"])
    runs.append((name, name.split("-")[1], {r["variant"]: r["step_ms"] for r in report["timing"]}, ok,
                 report.get("device_name", "?"), report.get("torch", "?"), report.get("preset", "?")))
variants = sorted({v for run in runs for v in run[2]})
first = runs[0] if runs else ("", "", {}, False, "?", "?", "?")
lines = [f"# Dion3 f=1/4, {first[6]}, FSDP2 at one rank: old vs new ({first[4]}, torch {first[5]})", "",
         f"old: {old} (sources {digest(old)}); new: {new} (sources {digest(new)}); median of {steps} steps "
         f"after {warmup} warm-up steps per run", "",
         "| run | tree | " + " | ".join(f"{v} ms" for v in variants) + " | equivalence |",
         "|---|---|" + "---|" * len(variants) + "---|"]
for name, side, times, ok, *_ in runs:
    cells = " | ".join(f"{times[v]:.2f}" if v in times else "—" for v in variants)
    lines.append(f"| {name.split('-')[0]} | {side} | {cells} | {'ok' if ok else 'MISMATCH'} |")
lines.append("")
for v in variants:
    by = {side: [t[v] for _, s, t, *_ in runs if s == side and v in t] for side in ("old", "new")}
    if by["old"] and by["new"]:
        o, n = statistics.mean(by["old"]), statistics.mean(by["new"])
        lines.append(f"- {v}: old {o:.2f} ms, new {n:.2f} ms, new/old {n / o:.3f} ({n - o:+.2f} ms)")
text = "\n".join(lines) + "\n"
with open(os.path.join(outdir, "summary.md"), "w") as f:
    f.write(text)
print(text)
EOF
rm -rf "$WORK"
exit $failed
