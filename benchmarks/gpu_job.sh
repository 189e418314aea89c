#!/usr/bin/env bash
# One job on a GPU machine whose output folder comes back as a few files only: records the machine,
# builds (or finds) the cached corpus, runs COMMAND with $WORK as its output folder, and packs $WORK
# into ARCHIVE every 30 s and at the end, so a job stopped at its time limit still returns every run
# that finished.
#
#   benchmarks/gpu_job.sh ARCHIVE.tgz 'COMMAND'       # e.g. ARCHIVE=$OUT/job.tgz; COMMAND writes under $WORK
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
