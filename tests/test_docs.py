"""The documents point at things that exist: every relative link resolves, every benchmark script,
module and result record they name is in the tree, every "DESIGN §N" names a section of
docs/design.md, and benchmarks/ stays the size its README promises (every script listed there).

"Every" means every tracked .md, .py and .sh file (git ls-files; the folders below where git is
not at hand), records under benchmarks/results/ included. A record may name a script or module
that lived only at an older commit if the same paragraph says how to get it back, in exactly
this form: (at commit b40dcc7: `git show b40dcc7:benchmarks/quality_study.py`)."""
from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
DESIGN = ROOT / "docs" / "design.md"
SRC = ROOT / "src"
RECORD_NAME = re.compile(r"[\w.-]*-20\d\d-\d\d-\d\d[\w*.-]*\.(?:md|jsonl|json|png|txt)(?!\w)|[\w-]*-20\d\d-\d\d-\d\d[\w-]*/")

# The way back to a file that lived only at an older commit, in the one accepted form.
WAY_BACK = re.compile(r"\(at commit ([0-9a-f]{7,40}): `git show \1:([\w./-]+)`\)")
MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*\w)")
SCRIPT = re.compile(r"benchmarks/([\w-]+\.(?:py|sh))(?![\w.])")
DESIGN_CITATION = re.compile(r"(?:DESIGN|docs/design\.md) §(\d+)")
# -m modules from outside src/ that commands may name: the standard library's and those of the
# packages the project depends on (torch.distributed.run, pytest).
OUTSIDE_PACKAGES = {"torch", "pytest"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _tracked() -> list[Path]:
    """Every tracked .md, .py and .sh file; without git, those of the folders that hold them."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "*.md", "*.py", "*.sh"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split("\0")
        files = [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if files:
        return sorted(files)
    found = {p for p in ROOT.glob("*.md")}
    for folder in ("benchmarks", "docs", "examples", "src", "tests"):
        found |= {p for p in (ROOT / folder).rglob("*") if p.suffix in (".md", ".py", ".sh") and p.is_file()}
    return sorted(p for p in found if "__pycache__" not in p.parts)


TRACKED = _tracked()


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each block between blank lines."""
    out, start, lines = [], 1, []
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            out.append((start, "\n".join(lines)))
            lines = []
    if lines:
        out.append((start, "\n".join(lines)))
    return out


@functools.lru_cache(maxsize=None)
def _history_checkable() -> bool:
    """Whether this checkout has the history a way back names (git at hand, not shallow)."""
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return False
    return shallow == "false"


@functools.lru_cache(maxsize=None)
def _at_commit(commit: str, path: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=ROOT,
                          capture_output=True).returncode == 0


def _ways_back(paragraph: str) -> set[str]:
    """The paths whose way back this paragraph gives."""
    return {path for _, path in WAY_BACK.findall(paragraph)}


def _module_files(module: str) -> list[str]:
    base = "src/" + module.replace(".", "/")
    return [base + ".py", base + "/__main__.py"]


def _module_exists(module: str) -> bool:
    """A module `python -m` can run: under src/ (a package needs its __main__.py), else the
    standard library's or one of OUTSIDE_PACKAGES' (looked up, not imported, where possible)."""
    top = module.split(".")[0]
    if (SRC / top).is_dir():
        return any((ROOT / name).is_file() for name in _module_files(module))
    if top in sys.stdlib_module_names or top in OUTSIDE_PACKAGES:
        try:
            return importlib.util.find_spec(module) is not None
        except ImportError:
            return False
    return False


@pytest.mark.parametrize("doc", [p for p in TRACKED if p.suffix == ".md"], ids=_rel)
def test_relative_links_resolve(doc):
    """Every relative markdown link of every tracked .md file names a file or folder that exists."""
    broken = []
    for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", doc.read_text()):
        if not re.match(r"[a-z]+://|mailto:", target) and not (doc.parent / target).exists():
            broken.append(target)
    assert not broken, f"{_rel(doc)}: links to missing files {broken}"


@pytest.mark.parametrize("path", TRACKED, ids=_rel)
def test_named_scripts_and_modules_exist(path):
    """Every script named under benchmarks/ and every `python -m X` names what is in the tree today, or
    its paragraph gives the way back to it (WAY_BACK) and that commit holds it."""
    missing, unreachable = [], []
    for line, paragraph in _paragraphs(path.read_text()):
        ways = _ways_back(paragraph)
        for script in SCRIPT.findall(paragraph):
            if not (BENCHMARKS / script).exists() and f"benchmarks/{script}" not in ways:
                missing.append(f"line {line}: benchmarks/{script}")
        for module in MODULE.findall(paragraph):
            if not _module_exists(module) and not ways & set(_module_files(module)):
                missing.append(f"line {line}: python -m {module}")
        if _history_checkable():
            unreachable += [f"line {line}: {commit}:{name}" for commit, name in WAY_BACK.findall(paragraph)
                            if not _at_commit(commit, name)]
    assert not missing, f"{_rel(path)} names scripts or modules that do not exist, with no way back: {missing}"
    assert not unreachable, f"{_rel(path)} gives ways back to files those commits do not hold: {unreachable}"


def test_benchmarks_readme_names_only_existing_scripts():
    """benchmarks/README.md names its scripts bare, as `NAME.py`."""
    named = set(re.findall(r"`([\w-]+\.(?:py|sh))`", (BENCHMARKS / "README.md").read_text()))
    assert sorted(s for s in named if not (BENCHMARKS / s).exists()) == []


def _design_sections() -> list[int]:
    """The numbers of docs/design.md's sections ("## N. Title"), in order; [] without the file."""
    return [int(n) for n in re.findall(r"^## (\d+)\. ", DESIGN.read_text(), re.M)] if DESIGN.is_file() else []


def test_design_sections_are_numbered():
    """docs/design.md exists and numbers its sections 1, 2, ... in order."""
    assert DESIGN.is_file(), "docs/design.md is missing"
    numbers = _design_sections()
    assert numbers and numbers == list(range(1, len(numbers) + 1)), numbers


@pytest.mark.parametrize("path", TRACKED, ids=_rel)
def test_design_citations_name_sections(path):
    """Every "DESIGN §N" (or "docs/design.md §N") names a section N of docs/design.md."""
    cited = {int(n) for n in DESIGN_CITATION.findall(path.read_text())}
    absent = sorted(cited - set(_design_sections()))
    assert not absent, f"{_rel(path)} cites sections {absent} that docs/design.md does not have"


@pytest.mark.parametrize("path", TRACKED, ids=_rel)
def test_named_result_records_exist(path):
    """Every result record named (NAME-YYYY-MM-DD...) is under benchmarks/results, unless named
    with its way back: WAY_BACK, or a `git log ...` command that finds its removal."""
    missing = []
    text = re.sub(r"`git log [^`]*`", "", WAY_BACK.sub("", path.read_text()))
    for name in set(RECORD_NAME.findall(text)):
        if not any(RESULTS.rglob(name.rstrip("/"))):
            missing.append(name)
    assert not missing, f"{_rel(path)} names result records that are not in benchmarks/results: {sorted(missing)}"


def test_benchmarks_hold_what_is_maintained():
    """At most 20 scripts, each listed in benchmarks/README.md, and at most 45 files of results."""
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    readme = (BENCHMARKS / "README.md").read_text()
    assert len(scripts) <= 20, scripts
    assert [s for s in scripts if f"`{s}`" not in readme] == [], "scripts missing from benchmarks/README.md"
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 45, f"{len(files)} files under benchmarks/results"


def test_the_readme_states_the_suite_size():
    """"About N tests" in the README's set-up is within 5% of the tests the whole suite collects."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests")], capture_output=True, text=True, cwd=ROOT).stdout
    collected = int(re.search(r"(\d+) tests? collected", out)[1])
    stated = int(re.search(r"About ([\d,]+) tests", (ROOT / "README.md").read_text())[1].replace(",", ""))
    assert abs(stated - collected) <= 0.05 * collected, (stated, collected)
