"""`python -m dion3.tools.study.land`: a job archive's runs land once; a key already held is listed
with both results, never appended again; a cut-short line is left out; --dry-run writes nothing."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from dion3.tools.study import land
from dion3.tools.study.runs import Run

LANDED = Path(__file__).parent.parent / "benchmarks/results/frontier/results.jsonl"


def _record(seed: int, loss: float, skipped: int = 0) -> dict:
    """A record as the study writes it: a landed run's config with another seed and its own key."""
    template = json.loads(LANDED.read_text().splitlines()[-1])
    config = {**template["config"], "seed": seed, "horizon": 100}
    return {**template, "config": config, "seed": seed, "horizon": 100, "key": Run(**{**config, "data": None}).key,
            "final_val_loss": loss, "nonfinite_updates": skipped, "first_nonfinite_step": None}


def _archive(path: Path, files: dict) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_a_job_lands_its_new_runs_once_and_lists_a_held_key_beside_its_record(tmp_path):
    into = tmp_path / "results.jsonl"
    held = _record(0, 0.7001)
    into.write_text(json.dumps(held) + "\n")
    rerun, new, other = _record(0, 0.7010, skipped=2), _record(1, 0.7020), _record(2, 0.7030)
    job = _archive(tmp_path / "job.tgz", {
        "./machine.txt": "2026-12-06T07:58:48Z\nNVIDIA H100 80GB HBM3, 580.159.04\n",
        "./run-a/results.jsonl": json.dumps(rerun) + "\n" + json.dumps(new) + "\n",
        "./run-b/results.jsonl": json.dumps(other) + "\n" + json.dumps(other)[:40],  # killed mid-line
        "./run-b/summary.md": "not a record",
    })
    out = io.StringIO()
    assert land.land([job], into, dry_run=True, out=out) == (2, 1)
    assert into.read_text() == json.dumps(held) + "\n"  # the dry run wrote nothing
    out = io.StringIO()
    assert land.land([job], into, out=out) == (2, 1)
    lines = [json.loads(line) for line in into.read_text().splitlines()]
    assert [r["key"] for r in lines] == [held["key"], new["key"], other["key"]]
    assert lines[0]["final_val_loss"] == 0.7001  # the held record is kept, the rerun not pooled
    text = out.getvalue()
    assert "(2026-12-06T07:58:48Z · NVIDIA H100 80GB HBM3, 580.159.04)" in text
    row = next(line for line in text.splitlines() if "0.7010" in line)
    assert "seed=0" in row and "| 2 |" in row and "no: key held, its loss 0.7001 with 0 skipped" in row
    assert "2 runs landed" in text and "1 already there" in text
    assert land.land([job], into, out=io.StringIO()) == (0, 3)  # again: nothing new


def test_a_folder_lands_as_an_archive_does_and_a_bad_path_is_refused(tmp_path, capsys):
    folder = tmp_path / "job"
    (folder / "run").mkdir(parents=True)
    (folder / "run" / "results.jsonl").write_text(json.dumps(_record(3, 0.71)) + "\n")
    into = tmp_path / "out" / "results.jsonl"
    assert land.main([str(folder), "--into", str(into)]) == 0
    assert [json.loads(line)["seed"] for line in into.read_text().splitlines()] == [3]
    (tmp_path / "notes.txt").write_text("not an archive")
    for bad, message in ((tmp_path / "notes.txt", "not a job archive or folder"), (tmp_path / "absent.tgz", "no such")):
        with pytest.raises(SystemExit):
            land.main([str(bad), "--into", str(into)])
        assert message in capsys.readouterr().err
