#!/usr/bin/env bash
# One job on a GPU machine, packed into one archive: makes a fresh temporary folder $WORK (exported),
# records the machine in $WORK/machine.txt (date, GPU, driver, torch/CUDA/Triton versions, cores),
# builds (or finds) the cached corpus under $DION3_CACHE (default /tmp/dion3-cache; log in
# $WORK/corpus.log), runs COMMAND with bash, and packs $WORK into ARCHIVE every 30 s and once more at
# the end, so a job killed before it ends still leaves every run that finished in ARCHIVE. The exit
# status is COMMAND's.
#
#   benchmarks/gpu_job.sh ARCHIVE.tgz 'COMMAND'       # COMMAND writes its outputs under $WORK
#   e.g. benchmarks/gpu_job.sh /tmp/study.tgz 'python -m dion3.tools.study --model llama-384 --out $WORK/study'
set -u
archive=${1:?ARCHIVE.tgz}; command=${2:?COMMAND}
WORK=$(mktemp -d); export WORK
export DION3_CACHE=${DION3_CACHE:-/tmp/dion3-cache} PYTHONUNBUFFERED=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
pack() { tar -czf "$archive.part" -C "$WORK" . && mv "$archive.part" "$archive"; }
( while sleep 30; do pack; done ) &
packer=$!
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nproc
} > "$WORK/machine.txt" 2>&1
python -c "from dion3.tools.train.corpus import python_source_corpus; python_source_corpus(progress=print)" > "$WORK/corpus.log" 2>&1
bash -c "$command"
status=$?
kill "$packer"
pack
exit $status
