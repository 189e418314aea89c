"""A corpus large enough to be read once: every Python source file installed with this
interpreter (the standard library and site-packages: torch, numpy, …), as bytes.

Quality claims need data that a run reads at most once: a corpus read several times measures
memorization. A machine with torch installed holds 300+ MB of `.py` files, enough for thousands
of steps of a small model (1500 steps of 32 × 512 bytes read 25 MB).

Files are found under the interpreter's own directories (sys.prefix, the standard library and
site-packages), deduplicated by content (the same module installed twice counts once), ordered
by content hash (so the order never depends on the file system) and split into training and
validation by file: a file goes to validation when the CRC-32 of its content hash falls in the
validation share. The two streams are written once to a cache directory as raw bytes and
memory-mapped after that, so that many runs on one machine share one copy in the page cache.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import site
import sys
import sysconfig
import zlib
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch

from .data import BYTE_VOCAB, TokenData

CACHE_ENV = "DION3_CACHE"
_SKIP_DIRS = {"__pycache__", ".git"}


def default_roots() -> list[Path]:
    """The interpreter's directories that hold Python source, without nesting duplicates."""
    candidates = [sys.prefix, sys.base_prefix, *sysconfig.get_paths().values()]
    candidates += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    roots = sorted({Path(c).resolve() for c in candidates if c and Path(c).is_dir()}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for root in roots:
        if not any(root.is_relative_to(parent) for parent in kept):
            kept.append(root)
    return kept


def python_files(roots: Iterable[Path]) -> list[Path]:
    """Every regular `.py` file under roots (symbolic links to directories are not followed)."""
    found = set()
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
            found.update(Path(folder, n) for n in names if n.endswith(".py"))
    return sorted(p for p in found if p.is_file())


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dion3")


def _fingerprint(files: Sequence[Path], val_fraction: float) -> str:
    digest = hashlib.sha1(f"{val_fraction!r}".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def build_corpus(files: Sequence[Path], folder: Path, val_fraction: float,
                 progress: Optional[Callable[[str], None]] = None) -> dict:
    """Write folder/train.u8 and folder/val.u8 (deduplicated file contents) and meta.json."""
    folder.mkdir(parents=True, exist_ok=True)
    by_hash: dict[str, bytes] = {}
    for number, path in enumerate(files, 1):
        try:
            content = path.read_bytes()
        except OSError:
            continue  # unreadable files (permissions, broken links) are left out
        if content:
            by_hash.setdefault(hashlib.sha1(content).hexdigest(), content)
        if progress and number % 5000 == 0:
            progress(f"corpus: read {number}/{len(files)} files")
    sizes = {False: 0, True: 0}
    counts = {False: 0, True: 0}
    partial = {split: folder / f"{name}.u8.partial" for split, name in ((False, "train"), (True, "val"))}
    with open(partial[False], "wb") as train, open(partial[True], "wb") as val:
        for digest in sorted(by_hash):
            is_val = zlib.crc32(digest.encode()) % 10_000 < val_fraction * 10_000
            (val if is_val else train).write(by_hash[digest])
            sizes[is_val] += len(by_hash[digest])
            counts[is_val] += 1
    meta = dict(files_found=len(files), unique_files=len(by_hash), train_files=counts[False], val_files=counts[True],
                train_bytes=sizes[False], val_bytes=sizes[True], val_fraction=val_fraction)
    for split, name in ((False, "train"), (True, "val")):
        partial[split].replace(folder / f"{name}.u8")
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))  # last: marks the cache complete
    return meta


def _mapped(path: Path, size: int) -> torch.Tensor:
    """The file's bytes as a uint8 tensor backed by the page cache (shared between processes)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def python_source_corpus(roots: Optional[Sequence[Path]] = None, cache_dir: Optional[Path] = None,
                         val_fraction: float = 0.02, progress: Optional[Callable[[str], None]] = None) -> TokenData:
    """The installed Python source as a byte corpus (built on first use, then cached).

    roots: directories to search (default: default_roots()); cache_dir: where the streams are
    kept (default: $DION3_CACHE or ~/.cache/dion3). Tokens stay uint8 (a 300 MB corpus as
    int64 would take 2.4 GB per process); batches are widened when they are cut."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction!r}")
    roots = [Path(r) for r in roots] if roots is not None else default_roots()
    files = python_files(roots)
    if not files:
        raise FileNotFoundError(f"no .py files under {', '.join(map(str, roots))}")
    folder = (cache_dir or default_cache_dir()) / f"python-corpus-{_fingerprint(files, val_fraction)}"
    meta_path = folder / "meta.json"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:  # runs started together build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
        else:
            if progress:
                progress(f"corpus: building from {len(files)} .py files under {', '.join(map(str, roots))} into {folder}")
            meta = build_corpus(files, folder, val_fraction, progress)
    train = _mapped(folder / "train.u8", meta["train_bytes"])
    val = _mapped(folder / "val.u8", meta["val_bytes"])
    description = (f"installed Python source ({meta['unique_files']} unique .py files, "
                   f"{meta['train_bytes'] / 1e6:.1f} MB train / {meta['val_bytes'] / 1e6:.1f} MB validation)")
    return TokenData(train, val, BYTE_VOCAB, description)
