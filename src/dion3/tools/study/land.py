"""Land the records of GPU jobs: every run in the jobs' archives (`benchmarks/gpu_job.sh`) or
folders goes into one results file, once.

    python -m dion3.tools.study.land JOB.tgz ... --into benchmarks/results/frontier/results.jsonl

Each run folder's results.jsonl in an archive is read (a line cut short by a kill is left out, as
the study leaves it out); a run whose key the file already holds is not added again but listed
beside the landed record, with both losses and skip counts, so a rerun of a landed setting (the
same seed, alone on the GPU) is seen and never pooled twice. A table per archive names every run,
its loss, its card, its skipped updates and whether it landed; `--dry-run` prints it and writes
nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .launch import parse_results, read_results
from .runs import Run


@dataclass
class Found:
    source: str  # the archive (or folder) and the run folder in it
    record: dict


def read_job(path: Path) -> tuple[list[Found], str]:
    """(the runs of one job, its machine.txt), from an archive of gpu_job.sh or a folder."""
    found, machine = [], ""
    if path.is_dir():
        for results in sorted(path.rglob("results.jsonl")):
            found += [Found(f"{path.name}/{results.parent.relative_to(path)}", r) for r in read_results(results)]
        machine_file = path / "machine.txt"
        machine = machine_file.read_text() if machine_file.exists() else ""
        return found, machine
    try:
        archive = tarfile.open(path)
    except (OSError, tarfile.TarError) as error:
        raise ValueError(f"{path}: not a job archive or folder ({error})") from None
    with archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            name = member.name.removeprefix("./")
            if not member.isfile():
                continue
            data = archive.extractfile(member).read().decode(errors="replace")
            if name.endswith("/results.jsonl") or name == "results.jsonl":
                found += [Found(f"{path.name}/{name.rsplit('/', 1)[0] if '/' in name else '.'}", r)
                          for r in parse_results(data)]
            elif name == "machine.txt":
                machine = data
    return found, machine


def describe(record: dict) -> str:
    """The run in the study's words: its setting, lr, μ, batch, horizon and seed."""
    config = record.get("config", {})
    try:
        label = Run(**{**config, "data": None}).label
    except TypeError:  # a record of a study older than these fields
        label = (f"{config.get('optimizer')} {config.get('fraction')} lr={config.get('lr')} mu={config.get('mu')} "
                 f"h={record.get('horizon')} seed={record.get('seed')}")
    return f"{label} batch={config.get('batch_size')}"


def land(jobs: Sequence[Path], into: Path, dry_run: bool = False, out=sys.stdout) -> tuple[int, int]:
    """Append the jobs' new runs to `into` (keys it does not hold yet); (landed, already there)."""
    held = {r["key"]: r for r in read_results(into)}
    new_lines, repeated = [], 0
    for job in jobs:
        found, machine = read_job(job)
        machine_text = " · ".join(line.strip() for line in machine.splitlines() if line.strip())
        print(f"## {job.name}: {len(found)} runs" + (f" ({machine_text})" if machine_text else ""), file=out)
        print("| run | folder | final val loss | card | skipped updates | landed |\n|---|---|---|---|---|---|", file=out)
        for each in found:
            record, key = each.record, each.record["key"]
            skips = record.get("nonfinite_updates", 0)
            if key in held:
                repeated += 1
                before = held[key]
                verdict = (f"no: key held, its loss {before['final_val_loss']:.4f} with "
                           f"{before.get('nonfinite_updates', 0)} skipped")
            else:
                held[key] = record
                new_lines.append(json.dumps(record))
                verdict = "yes"
            finite = record.get("first_nonfinite_step") is None
            print(f"| {describe(record)} | {each.source} | {record['final_val_loss']:.4f}"
                  f"{'' if finite else ' (non-finite at step ' + str(record['first_nonfinite_step']) + ')'} | "
                  f"{record.get('card', 'not recorded')} | {skips} | {verdict} |", file=out)
    if new_lines and not dry_run:
        into.parent.mkdir(parents=True, exist_ok=True)
        existing = into.read_text() if into.exists() else ""
        with open(into, "a") as handle:
            if existing and not existing.endswith("\n"):
                handle.write("\n")
            handle.write("\n".join(new_lines) + "\n")
    print(f"\n{len(new_lines)} runs {'to land' if dry_run else 'landed'} in {into}, {repeated} already there", file=out)
    return len(new_lines), repeated


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dion3.tools.study.land", description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", type=Path, nargs="+", help="job archives (gpu_job.sh's .tgz) or folders")
    parser.add_argument("--into", type=Path, required=True, help="the results file (e.g. benchmarks/results/frontier/"
                        "results.jsonl)")
    parser.add_argument("--dry-run", action="store_true", help="print what would land, write nothing")
    args = parser.parse_args(argv)
    missing = [str(j) for j in args.jobs if not j.exists()]
    if missing:
        parser.error(f"no such archive or folder: {', '.join(missing)}")
    try:
        land(args.jobs, args.into, args.dry_run)
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
