"""Token streams for the training demo.

Three sources, one result (`TokenData`: a train and a validation stream of token ids):

* default: the Python standard library's own source files, read as bytes (vocabulary 256);
* text files (paths or directories, searched recursively), also read as bytes;
* GPT-2-token `.bin` shards (the common FineWeb format: a 256-int32 header — magic 20240520,
  version 1, token count — then that many uint16 tokens; vocabulary 50257).

Everything is deterministic: files are ordered by their path (not by the file system's listing
order), and a text file goes to validation when the CRC-32 of its relative path falls in the
validation share, so the split never depends on how many files there are or in what order they
were found. Shards whose name contains "val" form the validation set; without such shards, the
last `val_fraction` of the concatenated tokens is held out.
"""
from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
GPT2_VOCAB = 50257
BYTE_VOCAB = 256
# Directories below the stdlib root that are not the standard library proper (installed
# packages) or that distributions often strip (the test suite).
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}

PathLike = Union[str, Path]


@dataclass
class TokenData:
    train: Tensor  # 1-D int64 token ids
    val: Tensor
    vocab_size: int  # number of distinct token ids the source can produce
    description: str

    def __post_init__(self):
        for name in ("train", "val"):
            if getattr(self, name).numel() < 2:
                raise ValueError(f"data source {self.description!r}: the {name} split is empty or has a single token")


def stdlib_files() -> tuple[Path, list[Path]]:
    """The root of the standard library and its .py files, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {root} not found; pass --data with text files instead")
    files = [
        p for p in root.rglob("*.py")
        if not _STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1]) and p.is_file()
    ]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_data(source: Optional[Union[PathLike, Sequence[PathLike]]] = None, val_fraction: float = 0.05) -> TokenData:
    """Load the default corpus (None), text files/directories, or `.bin` token shards."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction!r}")
    if source is None:
        root, files = stdlib_files()
        return _bytes_data(root, files, val_fraction, f"Python standard library ({root})")
    paths = [Path(source)] if isinstance(source, (str, Path)) else [Path(p) for p in source]
    if not paths:
        raise ValueError("data: no paths given")
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"data path {str(path)!r} does not exist")
    files = sorted({f for path in paths for f in _expand(path)}, key=lambda p: p.as_posix())
    if not files:
        raise ValueError(f"data: no files found under {', '.join(map(str, paths))}")
    shards = [f for f in files if f.suffix == ".bin"]
    if shards and len(shards) != len(files):
        raise ValueError("data: mixing .bin token shards with text files is not supported; pass one kind")
    if shards:
        return _shard_data(shards, val_fraction)
    root = paths[0] if len(paths) == 1 and paths[0].is_dir() else None
    return _bytes_data(root, files, val_fraction, ", ".join(map(str, paths)))


def _expand(path: Path) -> list[Path]:
    if path.is_dir():
        return [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return [path]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise OSError(f"cannot read data file {str(path)!r}: {error.strerror or error}") from error


def _in_validation(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000


def _bytes_data(root: Optional[Path], files: list[Path], val_fraction: float, description: str) -> TokenData:
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for path in files:
        name = path.relative_to(root).as_posix() if root is not None else path.as_posix()
        parts[len(files) > 1 and _in_validation(name, val_fraction)].append(_read(path))
    train, val = b"".join(parts[False]), b"".join(parts[True])
    if not val:  # one file, or an unlucky hash: hold out the tail instead
        cut = int(len(train) * (1.0 - val_fraction))
        train, val = train[:cut], train[cut:]
    return TokenData(_byte_tensor(train), _byte_tensor(val), BYTE_VOCAB, description)


def _byte_tensor(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else torch.empty(0, dtype=torch.long)


def read_shard(path: PathLike) -> Tensor:
    """Tokens of one `.bin` shard as int64, after checking its header against its size."""
    path = Path(path)
    raw = _read(path)
    header_bytes = SHARD_HEADER_INTS * 4
    if len(raw) < header_bytes:
        raise ValueError(f"token shard {str(path)!r} is {len(raw)} bytes, shorter than its {header_bytes}-byte header")
    header = np.frombuffer(raw, dtype="<i4", count=SHARD_HEADER_INTS)
    magic, version, count = (int(v) for v in header[:3])
    if magic != SHARD_MAGIC:
        raise ValueError(f"token shard {str(path)!r}: bad magic number {magic} (expected {SHARD_MAGIC})")
    if version != SHARD_VERSION:
        raise ValueError(f"token shard {str(path)!r}: unsupported version {version} (expected {SHARD_VERSION})")
    expected = header_bytes + 2 * count
    if count < 0 or len(raw) != expected:
        raise ValueError(
            f"token shard {str(path)!r}: header says {count} tokens ({expected} bytes with header), "
            f"but the file has {len(raw)} bytes"
        )
    tokens = torch.from_numpy(np.frombuffer(raw, dtype="<u2", offset=header_bytes).astype(np.int64))
    if tokens.numel() and int(tokens.max()) >= GPT2_VOCAB:
        raise ValueError(f"token shard {str(path)!r}: token id {int(tokens.max())} is outside the GPT-2 vocabulary ({GPT2_VOCAB})")
    return tokens


def write_shard(path: PathLike, tokens: Sequence[int]) -> None:
    """Write tokens in the shard format (used by the tests and for preparing small data sets)."""
    values = np.asarray(tokens, dtype=np.int64)
    if values.size and (values.min() < 0 or values.max() >= GPT2_VOCAB):
        raise ValueError(f"tokens must lie in [0, {GPT2_VOCAB}) to be written as uint16")
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, values.size)
    with open(path, "wb") as out:
        out.write(header.tobytes())
        out.write(values.astype("<u2").tobytes())


def _shard_data(shards: list[Path], val_fraction: float) -> TokenData:
    is_val = ["val" in shard.name for shard in shards]
    train = [read_shard(s) for s, v in zip(shards, is_val) if not v]
    val = [read_shard(s) for s, v in zip(shards, is_val) if v]
    description = f"{len(shards)} token shard(s) in {shards[0].parent}"
    if not train:
        raise ValueError(f"data: every shard name contains 'val'; give training shards too ({description})")
    train_tokens = torch.cat(train)
    if val:
        return TokenData(train_tokens, torch.cat(val), GPT2_VOCAB, description)
    cut = int(train_tokens.numel() * (1.0 - val_fraction))
    return TokenData(train_tokens[:cut], train_tokens[cut:], GPT2_VOCAB, description)


def _windows(tokens: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    offsets = starts[:, None] + torch.arange(seq_len + 1)
    chunk = tokens[offsets].long()  # a uint8 corpus (corpus.py) is widened batch by batch
    return chunk[:, :-1], chunk[:, 1:]


def _check_length(tokens: Tensor, seq_len: int, what: str) -> int:
    room = tokens.numel() - seq_len - 1
    if room < 0:
        raise ValueError(f"the {what} split has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    return room + 1


def train_batches(tokens: Tensor, batch_size: int, seq_len: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless random windows; the same seed gives the same batches, whatever the optimizer."""
    count = _check_length(tokens, seq_len, "train")
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield _windows(tokens, torch.randint(count, (batch_size,), generator=generator), seq_len)


def read_once_batches(tokens: Tensor, batch_size: int, seq_len: int, seed: int, steps: int) -> Iterator[tuple[Tensor, Tensor]]:
    """`steps` batches of windows that never share a byte: the train split cut into disjoint
    windows of seq_len + 1 tokens, taken in an order drawn from the seed. Refuses (ValueError)
    when the split holds fewer windows than the run needs, rather than read data twice."""
    stride = seq_len + 1
    available = tokens.numel() // stride
    needed = steps * batch_size
    if needed > available:
        raise ValueError(
            f"reading the data once needs {needed} windows of {stride} tokens ({steps} steps × {batch_size}), "
            f"but the train split ({tokens.numel()} tokens) holds {available}: use a larger corpus or fewer steps"
        )
    order = torch.randperm(available, generator=torch.Generator().manual_seed(seed))[:needed] * stride
    for chunk in order.split(batch_size):
        yield _windows(tokens, chunk, seq_len)


def val_batches(tokens: Tensor, batch_size: int, seq_len: int, num_batches: int) -> list[tuple[Tensor, Tensor]]:
    """A fixed validation set: windows evenly spread over the whole validation split."""
    count = _check_length(tokens, seq_len, "validation")
    starts = torch.linspace(0, count - 1, batch_size * num_batches).long()
    return [_windows(tokens, chunk, seq_len) for chunk in starts.split(batch_size)]
