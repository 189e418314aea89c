"""The documents point at things that exist: every relative link resolves, every benchmark script,
module and result record they name is in the tree, and benchmarks/ stays the size its README
promises (every script listed there)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
# What users read and run today; the records under results/ describe past commits, so only their
# links and the records they name are checked, not the scripts of the commit they measured.
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), BENCHMARKS / "README.md"]
RECORDS = sorted(RESULTS.rglob("*.md"))
SOURCES = sorted((ROOT / "src").rglob("*.py")) + sorted(BENCHMARKS.glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
RECORD_NAME = re.compile(r"[\w.-]*-20\d\d-\d\d-\d\d[\w*.-]*\.(?:md|jsonl|json|png|txt)(?!\w)|[\w-]*-20\d\d-\d\d-\d\d[\w-]*/")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", GUIDES + RECORDS, ids=_rel)
def test_relative_links_resolve(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", doc.read_text()):
        if not re.match(r"[a-z]+://|mailto:", target) and not (doc.parent / target).exists():
            broken.append(target)
    assert not broken, f"{_rel(doc)}: links to missing files {broken}"


@pytest.mark.parametrize("doc", GUIDES, ids=_rel)
def test_named_scripts_and_modules_exist(doc):
    text = doc.read_text()
    named = set(re.findall(r"benchmarks/([\w-]+\.(?:py|sh))", text))
    if doc.parent == BENCHMARKS:  # its own README names its scripts bare
        named |= set(re.findall(r"`([\w-]+\.(?:py|sh))`", text))
    scripts = {s for s in named if not (BENCHMARKS / s).exists()}
    modules = {m for m in re.findall(r"python3? -m (dion3[\w.]*)", text) if importlib.util.find_spec(m) is None}
    assert not scripts and not modules, f"{_rel(doc)}: missing scripts {sorted(scripts)}, modules {sorted(modules)}"


@pytest.mark.parametrize("path", GUIDES + RECORDS + SOURCES, ids=_rel)
def test_named_result_records_exist(path):
    missing = []
    text = re.sub(r"`git log [^`]*`", "", path.read_text())  # records removed from the tree, named with their way back
    for name in set(RECORD_NAME.findall(text)):
        if not any(RESULTS.rglob(name.rstrip("/"))):
            missing.append(name)
    assert not missing, f"{_rel(path)} names result records that are not in benchmarks/results: {sorted(missing)}"


def test_benchmarks_hold_what_is_maintained():
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    readme = (BENCHMARKS / "README.md").read_text()
    assert len(scripts) <= 20, scripts
    assert [s for s in scripts if f"`{s}`" not in readme] == [], "scripts missing from benchmarks/README.md"
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 40, f"{len(files)} files under benchmarks/results"
