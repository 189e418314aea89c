#!/usr/bin/env bash
# The regime study's GPU jobs by name (benchmarks/results/frontier/README.md, "The regime study:
# jobs in order"). A job starts its runs at once, one study process, folder and log each under
# $WORK, and waits; then prints each finished run's final loss. Run it inside gpu_job.sh:
#
#   bash benchmarks/gpu_job.sh $OUT/JOB.tgz 'bash benchmarks/regime_jobs.sh JOB'
#   bash benchmarks/regime_jobs.sh --dry-run JOB   # its runs, planned without training (no GPU needed)
#   bash benchmarks/regime_jobs.sh --dry-run all   # every job's runs
#
# Land a job: tar -xzf JOB.tgz -C DIR; cat DIR/*/results.jsonl >> benchmarks/results/frontier/results.jsonl
# (every record names its card; rerunning a study skips the runs its folder already holds).
# The seed jobs pick each family's and fraction's best from the landed records (--best-from), so
# the grid jobs of a batch size land before its seeds run.
set -u
STUDY="${PYTHON:-python} -m dion3.tools.study --model llama-384 --lr-warmup 50 --cooldown 0.3 --compile --horizons 1500"
DION3="--optimizers dion3 --fraction-warmup 0 --fraction-allocation cost --dion3-mu 0.6"
# the same 512 validation windows at every batch size
declare -A EVAL=([16]="--eval-batches 32" [32]="--eval-batches 16" [128]="--eval-batches 4" [256]="--eval-batches 2")
RECORDS=benchmarks/results/frontier
dry=""
pids=()
WORK=${WORK:-$(mktemp -d)}; mkdir -p "$WORK"

# run NAME BATCH STUDY-FLAGS...: one study in the background, its folder and log under $WORK
run() {
  local name=$1 batch=$2; shift 2
  local study=($STUDY --batch-size "$batch" ${EVAL[$batch]} "$@" --out "$WORK/$name")
  if [ -n "$dry" ]; then
    "${study[@]}" --dry-run | grep -v "^[0-9]* runs," | sed "s/^/$name (batch $batch): /"
  else
    "${study[@]}" > "$WORK/$name.log" 2>&1 &
    pids+=($!)
  fi
}
# alone NAME BATCH STUDY-FLAGS...: run, then wait for it: the next run starts once this one ends
alone() { run "$@"; [ -n "$dry" ] || wait "${pids[-1]}"; }
muon() { echo --optimizers muon --muon-lr "$1" --muon-mu "${2:-0.8}"; }
normuon() { echo --optimizers normuon --normuon-lr "$1" --normuon-mu 0.6; }
fraction() { echo $DION3 --fraction "$1" --dion3-lr "$2"; }
# the most rows within FRACTION's modeled time (fraction_allocation most_rows), at the by-cost settings' lr 0.02 and μ 0.6
rows() { echo --optimizers dion3 --fraction-warmup 0 --fraction-allocation most_rows --dion3-mu 0.6 --fraction "$1" --dion3-lr 0.02; }
# seeds of every best at BATCH: Muon, NorMuon, ½, ⅜ and ¼ by cost, five runs
best_seed() {
  run "b$1-best-seed$2" "$1" --best-from $RECORDS --seeds "$2" --optimizers muon,normuon,dion3 --fraction 0.5,0.375,0.25 \
    --fraction-allocation cost --fraction-warmup 0 --jobs 5
}

# the step-efficiency runs of SEED in three parts of 5250-6750 steps (two 3000-step runs at most, so
# each part fits a 10-minute job on a fresh machine); seed 0's Muon 1000/3000 and ½ 3000 are landed
long_part() {
  local part=$1 seed=$2
  case $part in
    a) run "b128-normuon-3000-s$seed" 128 $(normuon 0.02) --horizons 3000 --seeds "$seed"
       run "b128-quarter-3000-s$seed" 128 $(fraction 0.25 0.02) --horizons 3000 --seeds "$seed"
       run "b128-muon-750-s$seed" 128 $(muon 0.02) --horizons 750 --seeds "$seed" ;;
    b) run "b128-three8-3000-s$seed" 128 $(fraction 0.375 0.02) --horizons 3000 --seeds "$seed"
       run "b128-muon-2250-s$seed" 128 $(muon 0.02) --horizons 2250 --seeds "$seed"
       [ "$seed" = 0 ] || run "b128-muon-1000-s$seed" 128 $(muon 0.02) --horizons 1000 --seeds "$seed" ;;
    c) [ "$seed" != 0 ] || { echo "regime_jobs: b128-long-c-s0 is landed (Muon and ½ by cost at 3000, seed 0)" >&2; return 2; }
       run "b128-half-3000-s$seed" 128 $(fraction 0.5 0.02) --horizons 3000 --seeds "$seed"
       run "b128-muon-3000-s$seed" 128 $(muon 0.02) --horizons 3000 --seeds "$seed" ;;
  esac
}

# the held-out shape (llama-512-6l, no setting tuned on it) at llama-384's batch-128 settings verbatim:
# Muon at 1000, 1500 and 3000 steps, ⅜ and ½ by cost at 1500 and 3000, SEED; three parts of 5500-6000 steps
heldout_part() {
  local part=$1 seed=$2 H="--model llama-512-6l"
  case $part in
    a) run "heldout-muon-1000-s$seed" 128 $H $(muon 0.02) --horizons 1000 --seeds "$seed"
       run "heldout-muon-1500-s$seed" 128 $H $(muon 0.02) --horizons 1500 --seeds "$seed"
       run "heldout-three8-1500-s$seed" 128 $H $(fraction 0.375 0.02) --horizons 1500 --seeds "$seed"
       run "heldout-half-1500-s$seed" 128 $H $(fraction 0.5 0.02) --horizons 1500 --seeds "$seed" ;;
    b) run "heldout-muon-3000-s$seed" 128 $H $(muon 0.02) --horizons 3000 --seeds "$seed"
       run "heldout-three8-3000-s$seed" 128 $H $(fraction 0.375 0.02) --horizons 3000 --seeds "$seed" ;;
    c) run "heldout-half-3000-s$seed" 128 $H $(fraction 0.5 0.02) --horizons 3000 --seeds "$seed" ;;
  esac
}

job() {
  case $1 in
    b128-edges)  # the batch-128 grids' open edges (seed 0) and Muon's μ beside its best
      run b128-three8-0.015 128 $(fraction 0.375 0.015) --seeds 0
      run b128-quarter-0.02 128 $(fraction 0.25 0.02) --seeds 0
      run b128-half-0.02 128 $(fraction 0.5 0.02) --seeds 0
      run b128-normuon-0.01 128 $(normuon 0.01) --seeds 0
      run b128-muon-0.02-mu0.9 128 $(muon 0.02 0.9) --seeds 0 ;;
    b128-seed1) best_seed 128 1 ;;
    b128-seed2) best_seed 128 2 ;;
    b16-grid)  # batch 16, seed 0, around the batch-32 bests (host-bound runs: eight at once)
      run b16-muon-0.005 16 $(muon 0.005) --seeds 0
      run b16-muon-0.02 16 $(muon 0.02) --seeds 0
      run b16-normuon-0.01 16 $(normuon 0.01) --seeds 0
      run b16-normuon-0.02 16 $(normuon 0.02) --seeds 0
      run b16-half-0.01 16 $(fraction 0.5 0.01) --seeds 0
      run b16-half-0.02 16 $(fraction 0.5 0.02) --seeds 0
      run b16-three8-0.02 16 $(fraction 0.375 0.02) --seeds 0
      run b16-quarter-0.02 16 $(fraction 0.25 0.02) --seeds 0 ;;
    b16-seeds)  # seeds 1 and 2 of every batch-16 best, ten runs
      best_seed 16 1; best_seed 16 2 ;;
    b256-grid)  # batch 256 (10.4 tokens per parameter): the batch-128 bests and one step up, three runs
      run b256-muon-0.02 256 $(muon 0.02) --seeds 0
      run b256-muon-0.04 256 $(muon 0.04) --seeds 0
      run b256-half-0.03 256 $(fraction 0.5 0.03) --seeds 0 ;;
    b128-ns4)  # 4 Newton–Schulz steps before the row normalization, at the 5-step bests' lrs (seed 0)
      run b128-half-ns4 128 $(fraction 0.5 0.03) --ns-coefficients polar_express_4 --seeds 0
      run b128-three8-ns4 128 $(fraction 0.375 0.02) --ns-coefficients polar_express_4 --seeds 0
      run b128-normuon-ns4 128 $(normuon 0.02) --ns-coefficients polar_express_4 --seeds 0 ;;
    b32-muon-horizons)  # Muon's curve at batch 32 (its 1500-step best, lr 0.01, μ 0.8): 1000 and 2250 steps, seeds 0-2
      run b32-muon-1000 32 $(muon 0.01) --horizons 1000 --seeds 0,1,2 --jobs 3
      run b32-muon-2250 32 $(muon 0.01) --horizons 2250 --seeds 0,1,2 --jobs 3 ;;
    heldout-[ab]-s[0-2])
      heldout_part "${1:8:1}" "${1: -1}" ;;
    heldout-c-s01)  # ½ by cost at 3000 steps, seeds 0 and 1
      heldout_part c 0; heldout_part c 1 ;;
    heldout-c-s2)
      heldout_part c 2 ;;
    # the batch-128 Muon and NorMuon seeds one at a time, the GPU to one process: do skips remain? A run
    # alone takes about 4 minutes on an H100, so two a job; a first: the two seeds that skipped most
    # when five shared an H200 (Muon seed 0: 3 updates, NorMuon seed 1: 4)
    b128-alone-a)
      alone b128-alone-muon-s0 128 $(muon 0.02) --seeds 0; alone b128-alone-normuon-s1 128 $(normuon 0.02) --seeds 1 ;;
    b128-alone-b)  # Muon seed 2 skipped 1 shared, NorMuon seed 2 none
      alone b128-alone-muon-s2 128 $(muon 0.02) --seeds 2; alone b128-alone-normuon-s2 128 $(normuon 0.02) --seeds 2 ;;
    b128-alone-c)  # neither skipped shared
      alone b128-alone-muon-s1 128 $(muon 0.02) --seeds 1; alone b128-alone-normuon-s0 128 $(normuon 0.02) --seeds 0 ;;
    b128-screen-a)  # rule variants at batch 128, seed 0 (the time-to-loss issue's neighbour): where the rows go, μ, L2
      run b128-uniform-half 128 --optimizers dion3 --fraction-warmup 0 --fraction-allocation uniform --dion3-mu 0.6 \
        --fraction 0.5 --dion3-lr 0.02 --seeds 0
      run b128-uniform-three8 128 --optimizers dion3 --fraction-warmup 0 --fraction-allocation uniform --dion3-mu 0.6 \
        --fraction 0.375 --dion3-lr 0.02 --seeds 0
      run b128-half-mu0.8 128 $(fraction 0.5 0.02) --dion3-mu 0.8 --seeds 0
      run b128-three8-mu0.8 128 $(fraction 0.375 0.02) --dion3-mu 0.8 --seeds 0
      run b128-half-l2 128 $(fraction 0.5 0.02) --row-score l2 --seeds 0 ;;
    b128-screen-b)  # μ 0.5, rows by L2 at ⅜, and the MLP's gate/up rows weighted twice
      run b128-half-mu0.5 128 $(fraction 0.5 0.02) --dion3-mu 0.5 --seeds 0
      run b128-three8-mu0.5 128 $(fraction 0.375 0.02) --dion3-mu 0.5 --seeds 0
      run b128-three8-l2 128 $(fraction 0.375 0.02) --row-score l2 --seeds 0
      run b128-three8-mlp2 128 $(fraction 0.375 0.02) --fraction-weights gate_proj=2,up_proj=2 --seeds 0
      run b128-half-mlp2 128 $(fraction 0.5 0.02) --fraction-weights gate_proj=2,up_proj=2 --seeds 0 ;;
    b128-screen-c)  # the rule itself: the unselected rows' momentum decayed (d), and every row on every 8th step
      run b128-half-unselected0.9 128 $(fraction 0.5 0.02) --unselected-decay 0.9 --seeds 0
      run b128-half-unselected0.97 128 $(fraction 0.5 0.02) --unselected-decay 0.97 --seeds 0
      run b128-three8-unselected0.95 128 $(fraction 0.375 0.02) --unselected-decay 0.95 --seeds 0
      run b128-half-full8 128 $(fraction 0.5 0.02) --full-every 8 --seeds 0
      run b128-three8-full8 128 $(fraction 0.375 0.02) --full-every 8 --seeds 0 ;;
    b128-screen-c-decay0.9)  # its ½ by cost ×0.9 run, which died past step 1200 beside four others: alone
      alone b128-half-unselected0.9 128 $(fraction 0.5 0.02) --unselected-decay 0.9 --seeds 0 ;;
    b128-screen-d)  # the most rows within ½'s and ⅜'s modeled time (fraction_allocation most_rows): 0.78 and 0.68 of the rows
      run b128-half-rows 128 $(rows 0.5) --seeds 0
      run b128-three8-rows 128 $(rows 0.375) --seeds 0 ;;
    b128-rows-seeds)  # seeds 1 and 2 of the screen's best variant, ½ with the most rows (⅜'s gained nothing at seed 0)
      for seed in 1 2; do
        run "b128-half-rows-s$seed" 128 $(rows 0.5) --seeds "$seed"
      done ;;
    heldout-rows)  # the held-out check of the screen's best: llama-512-6l at batch 128, ½ with the most rows, seeds 0-2 at 1500
      for seed in 0 1 2; do
        run "heldout-half-rows-s$seed" 128 --model llama-512-6l $(rows 0.5) --seeds "$seed"
      done ;;
    b128-long-[abc]-s[0-2])  # step-efficiency: each setting at 3000 steps and Muon's curve (750-3000), one seed
      long_part "${1:10:1}" "${1: -1}" ;;
    *) echo "regime_jobs: unknown job '$1' (jobs: $JOBS)" >&2; return 2 ;;
  esac
}

JOBS="b128-edges b128-seed1 b128-seed2 b16-grid b16-seeds b256-grid b128-ns4 b128-long-a-s0 b128-long-b-s0 b128-long-a-s1 b128-long-b-s1 b128-long-c-s1 b128-long-a-s2 b128-long-b-s2 b128-long-c-s2 b32-muon-horizons heldout-a-s0 heldout-b-s0 heldout-a-s1 heldout-b-s1 heldout-a-s2 heldout-b-s2 heldout-c-s01 heldout-c-s2 b128-alone-a b128-alone-b b128-alone-c b128-screen-a b128-screen-b b128-screen-c b128-screen-c-decay0.9 b128-screen-d b128-rows-seeds heldout-rows"
case ${1:-} in
  --dry-run) dry=1; for j in $([ "${2:?JOB or all}" = all ] && echo $JOBS || echo "$2"); do echo "### $j"; job "$j" || exit $?; done; exit 0 ;;
  "") echo "usage: regime_jobs.sh JOB | --dry-run JOB|all (jobs: $JOBS)" >&2; exit 2 ;;
esac
job "$1" || exit $?
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done  # a failed run fails the job (its log says why)
for results in "$WORK"/*/results.jsonl; do
  [ -f "$results" ] && "${PYTHON:-python}" -c "import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line); c = r['config']
    rule = ''.join(f' {k} {c[k]:g}' for k, default in (('unselected_decay', 1), ('full_every', 0)) if c.get(k, default) != default)
    print(f\"{c['optimizer']:8} fraction {c['fraction']}{rule} lr {c['lr']:g} mu {c['mu']:g} batch {c['batch_size']} seed {r['seed']}: \"
          f\"{r['final_val_loss']:.4f} ({r.get('card')}; skipped steps {r['skipped_update_steps'][:5]})\")" "$results"
done
exit $status
