"""The study's parent: runs what results.jsonl does not hold yet, several processes at once,
appending one line per finished run (a stopped study keeps what finished and resumes)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .runs import Run

SRC = Path(__file__).resolve().parents[3]  # the folder holding the dion3 package, for the runs' processes


def read_results(path: Path) -> list[dict]:
    """Finished runs; a line cut short by a kill is ignored (the run is done again)."""
    return parse_results(path.read_text()) if path.exists() else []


def parse_results(text: str) -> list[dict]:
    """The records of a results.jsonl's text, without a line cut short by a kill."""
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def pending(runs: Sequence[Run], results_path: Path) -> list[Run]:
    """The runs whose results are not in results_path yet, in plan order."""
    done = {record["key"] for record in read_results(results_path)}
    return [run for run in runs if run.key not in done]


def _launch(run: Run, device: str, threads: Optional[int], out: Path, jobs: int) -> subprocess.Popen:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "dion3.tools.study", "--run-one", json.dumps(dataclasses.asdict(run)),
               "--device", device, "--result", str(logs / f"{run.key}.json"), "--runs-at-once", str(jobs)]
    if threads:
        command += ["--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    with open(logs / f"{run.key}.log", "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_study(runs: Sequence[Run], out: Path, jobs: int, devices: Sequence[str], threads: Optional[int],
              stop_after: Optional[float]) -> int:
    """Run what is not in OUT/results.jsonl yet, `jobs` at a time; returns the number of failures."""
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    if results_path.exists() and not results_path.read_bytes().endswith(b"\n") and results_path.stat().st_size:
        with open(results_path, "a") as handle:  # a line cut short by a kill: end it, so the next one is whole
            handle.write("\n")
    todo = pending(runs, results_path)
    print(f"quality study: {len(runs)} runs, {len(runs) - len(todo)} already in {results_path}, {len(todo)} to run, "
          f"{jobs} at a time on {', '.join(devices)}", flush=True)
    started, failures, finished = time.perf_counter(), 0, 0
    running: dict = {}  # process → (run, start time)
    slot = itertools.count()
    try:
        while todo or running:
            late = stop_after is not None and time.perf_counter() - started > stop_after * 60
            while todo and len(running) < jobs and not late:
                run = todo.pop(0)
                device = devices[next(slot) % len(devices)]
                running[_launch(run, device, threads, out, jobs)] = (run, time.perf_counter())
                print(f"started {run.label} on {device}", flush=True)
            if late and todo:
                print(f"--stop-after {stop_after:g} min reached: {len(todo)} runs not started (run again to do them)", flush=True)
                todo = []
            for process in [p for p in running if p.poll() is not None]:
                run, begun = running.pop(process)
                result_file = out / "logs" / f"{run.key}.json"
                if process.returncode == 0 and result_file.exists():
                    record = json.loads(result_file.read_text())
                    with open(results_path, "a") as handle:
                        handle.write(json.dumps(record) + "\n")
                    finished += 1
                    fraction = record["average_fraction"]
                    print(f"[{finished + failures}/{finished + failures + len(todo) + len(running)}] {run.label}: "
                          f"val {record['final_val_loss']:.4f}, share of rows orthogonalized {fraction:.3f}, "
                          f"optimizer {record['optimizer_ms_median']:.2f} ms (median), {time.perf_counter() - begun:.0f} s", flush=True)
                else:
                    failures += 1
                    tail = (out / "logs" / f"{run.key}.log").read_text().splitlines()[-15:]
                    print(f"FAILED {run.label} (exit {process.returncode}); log {out / 'logs' / (run.key + '.log')}:\n  "
                          + "\n  ".join(tail), flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        for process in running:
            process.terminate()
        for process in running:
            process.wait()
        print(f"interrupted: {finished} runs finished and kept in {results_path}", flush=True)
        raise
    print(f"{finished} runs finished, {failures} failed, {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    return failures


