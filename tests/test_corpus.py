"""The read-once corpus (dion3.tools.train.corpus) and read-once batches (data.read_once_batches):
deduplicated by content, split by file from a hash computed here independently, cached, and
windows that never share a token."""
from __future__ import annotations

import hashlib
import zlib

import pytest
import torch

from dion3.tools.train import corpus, data


def _tree(tmp_path):
    files = {"a.py": b"print('a')\n" * 40, "pkg/b.py": b"x = 1\n" * 90, "pkg/sub/c.py": b"def f():\n    pass\n" * 30,
             "copy/a.py": b"print('a')\n" * 40,  # the same module installed twice
             "notes.txt": b"not python", "pkg/__pycache__/b.py": b"cached copy"}
    for name, content in files.items():
        path = tmp_path / "root" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return tmp_path / "root", files


def test_corpus_is_unique_python_source_split_by_content_hash(tmp_path):
    root, files = _tree(tmp_path)
    tokens = corpus.python_source_corpus([root], cache_dir=tmp_path / "cache", val_fraction=0.5)
    unique = sorted({c for n, c in files.items() if n.endswith(".py") and "__pycache__" not in n},
                    key=lambda c: hashlib.sha1(c).hexdigest())
    in_val = [zlib.crc32(hashlib.sha1(c).hexdigest().encode()) % 10_000 < 5_000 for c in unique]
    want_train = b"".join(c for c, v in zip(unique, in_val) if not v)
    want_val = b"".join(c for c, v in zip(unique, in_val) if v)
    assert tokens.train.dtype == torch.uint8 and tokens.vocab_size == 256
    assert bytes(tokens.train.tolist()) == want_train and bytes(tokens.val.tolist()) == want_val
    assert "3 unique .py files" in tokens.description


def test_corpus_cache_is_reused_until_a_file_changes(tmp_path):
    root, _ = _tree(tmp_path)
    cache = tmp_path / "cache"
    first = corpus.python_source_corpus([root], cache_dir=cache, val_fraction=0.5)
    built = sorted(p.name for p in cache.iterdir())
    again = corpus.python_source_corpus([root], cache_dir=cache, val_fraction=0.5)
    assert sorted(p.name for p in cache.iterdir()) == built and torch.equal(first.train, again.train)
    (root / "a.py").write_bytes(b"changed = True\n" * 50)
    corpus.python_source_corpus([root], cache_dir=cache, val_fraction=0.5)
    assert len(list(cache.iterdir())) == len(built) + 1  # a new fingerprint, a new folder


def test_read_once_batches_never_repeat_a_token_and_refuse_too_many_steps():
    tokens = torch.arange(1000)  # every value once: a repeat would show
    seen = []
    for inputs, targets in data.read_once_batches(tokens, batch_size=3, seq_len=9, seed=4, steps=33):
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        seen += inputs.flatten().tolist() + targets[:, -1].tolist()
    assert len(seen) == len(set(seen)) == 33 * 3 * 10  # 99 of the 100 windows of 10 tokens
    other = next(data.read_once_batches(tokens, 3, 9, seed=5, steps=33))[0]
    assert not torch.equal(other, next(data.read_once_batches(tokens, 3, 9, seed=4, steps=33))[0])
    with pytest.raises(ValueError, match="reading the data once needs 102 windows"):
        next(data.read_once_batches(tokens, batch_size=3, seq_len=9, seed=4, steps=34))
