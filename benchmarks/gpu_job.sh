#!/usr/bin/env bash
# One job on a GPU machine, packed into one archive: makes a fresh temporary folder $WORK (exported),
# records the machine in $WORK/machine.txt (date, GPU, driver, torch/CUDA/Triton versions, cores),
# builds (or finds) the cached corpus under $DION3_CACHE (default /tmp/dion3-cache; log in
# $WORK/corpus.log; CORPUS=0 skips it for jobs that read none), runs COMMAND with bash, and packs
# $WORK into ARCHIVE every 30 s and once more at the end, so a job killed before it ends still leaves
# every run that finished in ARCHIVE. The exit status is COMMAND's.
#
# Compiles across machines: a fresh machine compiles every model again (a minute or more for each
# of several 350 M runs at once). inductor's cache (its Triton kernels inside) lives in
# $DION3_CACHE/compile; COMPILE_CACHE_FROM=FILE.tgz (e.g. a carried file of the checkout) fills it
# first, COMPILE_CACHE_TO=FILE.tgz (e.g. under $OUT) keeps it after the job for the next one.
#
#   benchmarks/gpu_job.sh ARCHIVE.tgz 'COMMAND'       # COMMAND writes its outputs under $WORK
#   e.g. benchmarks/gpu_job.sh /tmp/study.tgz 'python -m dion3.tools.study --model llama-384 --out $WORK/study'
set -u
archive=${1:?ARCHIVE.tgz}; command=${2:?COMMAND}
WORK=$(mktemp -d); export WORK
export DION3_CACHE=${DION3_CACHE:-/tmp/dion3-cache} PYTHONUNBUFFERED=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
pack() { tar -czf "$archive.part" -C "$WORK" . && mv "$archive.part" "$archive"; }
# the packer's sleep dies with it: one left behind keeps the output open, and a caller reading it waits up to 30 s
( trap 'kill $sleeper 2>/dev/null; exit' TERM; while :; do sleep 30 & sleeper=$!; wait $sleeper; pack; done ) &
packer=$!
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nproc
} > "$WORK/machine.txt" 2>&1
export TORCHINDUCTOR_CACHE_DIR="$DION3_CACHE/compile"
mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
if [ -n "${COMPILE_CACHE_FROM:-}" ] && [ -f "$COMPILE_CACHE_FROM" ]; then
  tar -xzf "$COMPILE_CACHE_FROM" -C "$TORCHINDUCTOR_CACHE_DIR" && echo "compile cache: from $COMPILE_CACHE_FROM" >> "$WORK/machine.txt"
fi
if [ "${CORPUS:-1}" != 0 ]; then
  python -c "from dion3.tools.train.corpus import python_source_corpus; python_source_corpus(progress=print)" > "$WORK/corpus.log" 2>&1
fi
bash -c "$command"
status=$?
kill "$packer"
pack
if [ -n "${COMPILE_CACHE_TO:-}" ]; then
  tar -czf "$COMPILE_CACHE_TO" -C "$TORCHINDUCTOR_CACHE_DIR" .
fi
exit $status
