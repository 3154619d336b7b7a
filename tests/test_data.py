"""Corpus discovery, token cache, split, batch loader and the unigram baseline."""

from __future__ import annotations

import json
import math
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from helios.data import (
    _relative_posix,
    BatchLoader,
    Corpus,
    load_tokens,
    open_corpus,
    prepare_dataset,
    split_tokens,
    stdlib_files,
    token_dtype,
    unigram_entropy,
)
from helios.fileio import load_checkpoint, save_checkpoint
from helios.tokenizer import BPETokenizer, ByteTokenizer


@pytest.fixture
def folder(tmp_path) -> Path:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / ".git").mkdir()
    (d / "b.txt").write_bytes(b"second file\nwith two lines\n")
    (d / "a.py").write_bytes(b"def f(x):\n    return x + 1\n")
    (d / "sub" / "c.md").write_bytes("# héading\n\nsome text\n".encode())
    (d / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (d / "empty.txt").write_bytes(b"")
    (d / ".hidden").write_bytes(b"secret")
    (d / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    return d


class CountingTokenizer:
    """Wraps a tokenizer and counts encode calls (to prove a cache hit does no work)."""

    def __init__(self, inner):
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.identity = inner.identity
        self.calls = 0

    def encode(self, data):
        self.calls += 1
        return self.inner.encode(data)

    def decode(self, ids):
        return self.inner.decode(ids)


# ----------------------------------------------------------------------------- corpus


def test_folder_corpus_order_and_skips(folder):
    c = open_corpus(folder)
    names = [p.relative_to(folder).as_posix() for p in c.files]
    assert names == ["a.py", "b.txt", "empty.txt", "image.png", "sub/c.md"]
    data = c.read_bytes()
    assert data == (b"def f(x):\n    return x + 1\n" + b"\n\n" + b"second file\nwith two lines\n"
                    + b"\n\n" + "# héading\n\nsome text\n".encode())
    assert [p.name for p in c.skipped] == ["image.png"]


def test_single_file_corpus(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"hello\xffworld")
    c = open_corpus(str(p))
    assert c.read_bytes() == b"hello\xffworld"


def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        open_corpus(tmp_path / "nope")
    (tmp_path / "e.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="e.txt.*empty"):
        open_corpus(tmp_path / "e.txt")
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(ValueError, match="no non-empty regular files"):
        open_corpus(d)
    (d / "bin").write_bytes(b"\0\1\2")
    with pytest.raises(ValueError, match="no text found.*1 skipped as binary"):
        open_corpus(d).read_bytes()


def test_fingerprint_tracks_file_changes(folder):
    f1 = open_corpus(folder).fingerprint
    assert open_corpus(folder).fingerprint == f1
    (folder / "b.txt").write_bytes(b"second file\nwith three lines\n")
    f2 = open_corpus(folder).fingerprint
    assert f2 != f1
    (folder / "new.txt").write_bytes(b"x")
    assert open_corpus(folder).fingerprint not in (f1, f2)


def test_fingerprint_keys_files_by_their_names_under_the_root(folder):
    """The fingerprint's file names are pathlib's relative_to(root).as_posix() (the token caches'
    keys depend on them), however the root is spelled."""
    import hashlib
    import struct

    (folder / "deeper" / "still").mkdir(parents=True)
    (folder / "deeper" / "still" / "c.txt").write_bytes(b"nested\n")
    c = open_corpus(folder)
    assert any(p.parent.name == "still" for p in c.files)
    h = hashlib.sha256(b"helios-corpus-v1\0" + c.separator + b"\0" + os.fsencode(c.root))
    for p in c.files:
        h.update(b"\0" + os.fsencode(p.relative_to(c.root).as_posix()))
        h.update(struct.pack("<qq", p.stat().st_size, p.stat().st_mtime_ns))
    assert c.fingerprint == h.hexdigest()[:16]
    for path, root in [("/a/b/c.txt", "/a"), ("/a/b/c.txt", "/a/"), ("x/y.txt", "x"), ("x.txt", "."), ("/r/x", "/")]:
        assert _relative_posix(Path(path), Path(root)) == Path(path).relative_to(Path(root)).as_posix()
    with pytest.raises(ValueError):
        _relative_posix(Path("/a/bc/d"), Path("/a/b"))  # a sibling whose name starts like the root is not under it


def test_stdlib_default_corpus():
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and len(rel) > 100
    assert "os.py" in rel and "json/__init__.py" in rel
    parts = {part for r in rel for part in r.split("/")[:-1]}
    assert not parts & {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    c = open_corpus(None)
    assert c.files == files and "standard library" in c.description


def test_stdlib_slice_bpe_round_trip(tmp_path):
    # A real slice of the default corpus through BPE training, the cache and back.
    files = stdlib_files()[:40]
    root = Path(sysconfig.get_paths()["stdlib"])
    c = Corpus(root, files, "stdlib slice")
    data = c.read_bytes()
    tok = BPETokenizer.train(data[: 300_000], 512)
    toks = load_tokens(c, tok, tmp_path)
    assert toks.dtype == np.uint16
    assert tok.decode(toks) == data
    assert len(toks) < len(data) / 2  # BPE must compress Python source


# ----------------------------------------------------------------------------- token cache


def test_token_cache_reuse(folder, tmp_path):
    c = open_corpus(folder)
    tok = CountingTokenizer(ByteTokenizer())
    t1 = load_tokens(c, tok, tmp_path / "cache")
    assert tok.calls > 0
    assert isinstance(t1, np.memmap) and t1.dtype == np.uint16 and not t1.flags.writeable
    assert tok.decode(t1) == c.read_bytes()
    (cached,) = (tmp_path / "cache").iterdir()
    assert cached.name == f"{c.fingerprint}-byte.tok"
    mtime = cached.stat().st_mtime_ns
    calls = tok.calls
    t2 = load_tokens(open_corpus(folder), tok, tmp_path / "cache")
    assert tok.calls == calls  # nothing re-tokenized
    assert cached.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(t1, t2)
    # editing the corpus invalidates the entry
    (folder / "a.py").write_bytes(b"changed\n")
    t3 = load_tokens(open_corpus(folder), tok, tmp_path / "cache")
    assert tok.calls > calls and tok.decode(t3).startswith(b"changed\n")


def test_token_cache_damaged_file_is_rebuilt(folder, tmp_path):
    c = open_corpus(folder)
    tok = CountingTokenizer(ByteTokenizer())
    cache = tmp_path / "cache"
    good = np.array(load_tokens(c, tok, cache))
    (cached,) = cache.iterdir()
    raw = bytearray(cached.read_bytes())
    raw[-1] ^= 0xFF
    cached.write_bytes(bytes(raw))
    calls = tok.calls
    again = load_tokens(c, tok, cache)
    assert tok.calls > calls
    np.testing.assert_array_equal(again, good)
    cached.write_bytes(bytes(raw[:100]))  # truncated
    np.testing.assert_array_equal(load_tokens(c, tok, cache), good)
    assert os.listdir(cache) == [cached.name]  # no temp files left


def test_token_dtype():
    assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_cache_dir_env(folder, tmp_path, monkeypatch):
    monkeypatch.delenv("HELIOS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    load_tokens(open_corpus(folder), ByteTokenizer())
    assert len(list((tmp_path / "xdg" / "helios" / "tokens").iterdir())) == 1


def test_prepare_dataset_bpe(folder, tmp_path):
    ds = prepare_dataset(folder, "bpe:270", cache_root=tmp_path)
    assert ds.tokenizer.vocab_size <= 270
    assert len(ds.train) + len(ds.val) == len(ds.tokens)
    assert ds.tokenizer.decode(ds.tokens) == ds.corpus.read_bytes()
    ds2 = prepare_dataset(folder, "bpe:270", cache_root=tmp_path)
    assert ds2.tokenizer.identity == ds.tokenizer.identity
    np.testing.assert_array_equal(ds2.tokens, ds.tokens)
    s = ds.summary()
    assert s["uniform_loss_nats"] == pytest.approx(math.log(ds.tokenizer.vocab_size))
    json.dumps(s)
    with pytest.raises(ValueError, match="accepted forms"):
        prepare_dataset(folder, "bpe:lots", cache_root=tmp_path)


# ----------------------------------------------------------------------------- split


def test_split_is_deterministic_tail():
    t = np.arange(1000, dtype=np.uint16)
    tr, va = split_tokens(t, 0.1)
    assert len(va) == 100 and va[0] == 900 and tr[-1] == 899
    tr2, va2 = split_tokens(t.copy(), 0.1)
    np.testing.assert_array_equal(va, va2)
    assert len(split_tokens(np.arange(5), 0.01)[1]) == 1
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="val_fraction"):
            split_tokens(t, bad)
    with pytest.raises(ValueError, match="at least 2"):
        split_tokens(t[:1])


# ----------------------------------------------------------------------------- loader


def test_batch_shapes_and_shift():
    t = np.arange(500, dtype=np.uint16)
    ld = BatchLoader(t, batch_size=4, block_size=16, seed=3)
    x, y = ld.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    np.testing.assert_array_equal(y - x, np.ones_like(x))  # consecutive ids: the window is contiguous
    assert x.min() >= 0 and y.max() <= 499


def test_batches_cover_the_whole_range():
    t = np.arange(20, dtype=np.int32)
    ld = BatchLoader(t, batch_size=64, block_size=4, seed=0)
    firsts = set()
    for _ in range(20):
        x, y = ld.next_batch()
        firsts.update(x[:, 0].tolist())
        assert y.max() <= 19
    assert firsts == set(range(16))  # every valid start (0 .. len - block - 1) occurs


def test_loader_seeds_and_determinism():
    t = np.arange(10_000, dtype=np.uint16)
    a = BatchLoader(t, 8, 32, seed=1)
    b = BatchLoader(t, 8, 32, seed=1)
    c = BatchLoader(t, 8, 32, seed=2)
    xa, xb, xc = a.next_batch()[0], b.next_batch()[0], c.next_batch()[0]
    np.testing.assert_array_equal(xa, xb)
    assert not np.array_equal(xa, xc)


def test_loader_resume_is_bit_exact(tmp_path):
    t = np.random.default_rng(0).integers(0, 1000, size=5000).astype(np.uint16)
    ref = BatchLoader(t, 4, 64, seed=7)
    for _ in range(5):
        ref.next_batch()
    # checkpoint the loader through the real checkpoint file (JSON meta) and restore it elsewhere
    save_checkpoint(tmp_path / "c.ckpt", {}, {"loader": ref.state_dict()})
    expected = [ref.next_batch() for _ in range(6)]
    _, meta = load_checkpoint(tmp_path / "c.ckpt")
    restored = BatchLoader(t, 4, 64, seed=999)
    restored.load_state_dict(meta["loader"])
    assert restored.batches_served == 5 and restored.seed == 7
    for (ex, ey), (gx, gy) in zip(expected, (restored.next_batch() for _ in range(6))):
        np.testing.assert_array_equal(ex, gx)
        np.testing.assert_array_equal(ey, gy)


def test_load_state_dict_rejects_mismatch():
    t = np.arange(1000, dtype=np.uint16)
    sd = BatchLoader(t, 4, 16).state_dict()
    with pytest.raises(ValueError, match="block_size: saved 16, now 32"):
        BatchLoader(t, 4, 32).load_state_dict(sd)
    with pytest.raises(ValueError, match="n_tokens"):
        BatchLoader(t[:900], 4, 16).load_state_dict(sd)
    with pytest.raises(ValueError, match="version"):
        BatchLoader(t, 4, 16).load_state_dict({**sd, "version": 0})


def test_iter_eval_fixed_and_independent_of_rng():
    t = np.arange(3000, dtype=np.uint16)
    ld = BatchLoader(t, 5, 20, seed=0)
    first = [x.copy() for x, _ in ld.iter_eval(3)]
    state = ld.rng.bit_generator.state
    ld.next_batch()
    second = [x.copy() for x, _ in ld.iter_eval(3)]
    assert len(first) == 3 and all(f.shape == (5, 20) for f in first)
    for f, s in zip(first, second):
        np.testing.assert_array_equal(f, s)
    starts = np.concatenate([f[:, 0] for f in first])
    assert starts[0] == 0 and starts[-1] == 3000 - 20 - 1  # spread over the whole split
    fresh = BatchLoader(t, 5, 20, seed=0)
    list(fresh.iter_eval(2))
    assert fresh.rng.bit_generator.state == BatchLoader(t, 5, 20, seed=0).rng.bit_generator.state
    assert state != ld.rng.bit_generator.state
    with pytest.raises(ValueError):
        list(ld.iter_eval(0))


def test_loader_errors():
    t = np.arange(10, dtype=np.uint16)
    with pytest.raises(ValueError, match="needs at least 11 tokens.*has 10"):
        BatchLoader(t, 1, 10)
    BatchLoader(t, 1, 9)  # exactly enough
    with pytest.raises(ValueError, match="batch_size"):
        BatchLoader(t, 0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BatchLoader(t, 1, 0)
    with pytest.raises(ValueError, match="1-D integer"):
        BatchLoader(t.astype(np.float32), 1, 4)
    with pytest.raises(ValueError, match="1-D integer"):
        BatchLoader(t.reshape(2, 5), 1, 4)


# ----------------------------------------------------------------------------- baseline


def test_unigram_entropy():
    assert unigram_entropy(np.array([3, 3, 3]), 10) == pytest.approx(0.0)
    assert unigram_entropy(np.arange(256), 256) == pytest.approx(math.log(256))
    t = np.array([0, 0, 0, 1], dtype=np.uint16)
    assert unigram_entropy(t, 2) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    # counted in chunks of a million tokens: the bits of counting them all at once, tail chunk included
    big = np.random.default_rng(0).integers(0, 300, (5 << 20) // 2 + 7).astype(np.uint16)
    counts = np.bincount(big, minlength=300)
    p = counts[counts > 0] / big.size
    assert unigram_entropy(big, 300) == float(-(p * np.log(p)).sum())
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        unigram_entropy(np.array([5]), 4)
    with pytest.raises(ValueError, match="no tokens"):
        unigram_entropy(np.array([], dtype=np.int64), 4)
