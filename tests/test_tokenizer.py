"""Byte and BPE tokenizers: lossless round trips, training determinism, persistence, specs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import helios.tokenizer as tk
from helios.tokenizer import SPLIT_PATTERN, BPETokenizer, ByteTokenizer, get_tokenizer, training_sample

TEXT = (
    b"def forward(self, x):\n    return self.proj(x) + 1234567\n\n"
    b"class Model(nn.Module):\n    '''Doc string, it's here.'''\n    def __init__(self):\n"
    b"        super().__init__()\n        self.w = 0.5  # comment\n\t\ttabs\r\n"
    + "na\u00efve caf\u00e9 \u65e5\u672c\u8a9e \U0001f600\n".encode()
) * 40


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(TEXT, 330)


def _edge_inputs() -> list[bytes]:
    rng = np.random.default_rng(1)
    out = [b"", b"\0", b"\0" * 7, b" ", b"  \n", b"\xff\xfe\xc3", b"\xc3(", b"a" * 1000, b" " * 300 + b"x",
           b"9" * 50, b"!" * 200, "é".encode() * 100, TEXT[:777]]
    out += [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in (1, 2, 3, 17, 256, 5000)]
    # random bytes biased to the characters the split pattern cares about
    alphabet = np.frombuffer(b" \n\tab_Z09'.(\0\x80\xff", dtype=np.uint8)
    out += [alphabet[rng.integers(0, len(alphabet), size=3000)].tobytes() for _ in range(3)]
    return out


def test_split_pattern_tiles_every_byte():
    pat = re.compile(SPLIT_PATTERN, re.DOTALL)
    for b in range(256):
        data = bytes([b]) * 3 + b" " + bytes([b])
        assert b"".join(pat.findall(data)) == data, b


def test_byte_tokenizer_round_trip():
    t = ByteTokenizer()
    for data in _edge_inputs():
        ids = t.encode(data)
        assert ids.dtype == np.int32 and ids.tolist() == list(data)
        assert t.decode(ids) == data
    assert t.encode("é").tolist() == [0xC3, 0xA9]
    assert t.decode_text(t.encode(b"ok\xff")) == "ok\ufffd"
    assert t.vocab_size == 256 and t.identity == "byte"
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        t.decode([300])


def test_bpe_round_trip_any_bytes(bpe):
    assert bpe.vocab_size == 330
    for data in _edge_inputs():
        ids = bpe.encode(data)
        assert ids.dtype == np.int32
        assert bpe.decode(ids) == data, data[:40]
    assert bpe.encode(b"").shape == (0,)
    assert bpe.decode([]) == b""
    assert bpe.decode_text(bpe.encode(b"caf\xc3")) == "caf\ufffd"
    assert bpe.encode("café").tolist() == bpe.encode("café".encode()).tolist()


def test_bpe_compresses_training_text(bpe):
    ids = bpe.encode(TEXT)
    assert len(ids) < len(TEXT) / 2  # repeated text: merges must cover much of it
    assert int(ids.max()) >= 256


def _reference_encode(tok: BPETokenizer, data: bytes) -> list[int]:
    """Replay every merge in order on each chunk: the definition that the fast path must match."""
    out: list[int] = []
    for chunk in re.findall(SPLIT_PATTERN, data, re.DOTALL):
        word = list(chunk)
        for r, (a, b) in enumerate(tok.merges):
            merged = tk._merge_word(word, a, b, 256 + r)
            if merged is not None:
                word = merged
        out.extend(word)
    return out


def test_bpe_encode_matches_merge_replay(bpe):
    for data in _edge_inputs()[:12] + [TEXT[:2000]]:
        assert bpe.encode(data).tolist() == _reference_encode(bpe, data)


def test_bpe_block_processing_equals_whole_input(bpe, monkeypatch):
    data = b"".join(_edge_inputs())
    whole = bpe.encode(data).tolist()
    for block in (1, 97, 200, 1000):
        monkeypatch.setattr(tk, "_BLOCK", block)
        fresh = BPETokenizer(bpe.merges)  # empty chunk cache
        assert fresh.encode(data).tolist() == whole, block


def test_bpe_training_is_deterministic():
    a = BPETokenizer.train(TEXT, 350)
    b = BPETokenizer.train(bytes(TEXT), 350)
    assert a.merges == b.merges and a.identity == b.identity
    c = BPETokenizer.train(TEXT, 351)
    assert c.merges[:-1] == a.merges  # one more merge extends, never reorders
    assert BPETokenizer(a.merges[:-1]).identity != a.identity


def test_bpe_training_matches_naive_recount():
    # The incremental pair counts must pick exactly the merges a full recount would.
    data = TEXT[:3000] + bytes(range(256))
    fast = BPETokenizer.train(data, 300)
    words = [list(c) for c in re.findall(SPLIT_PATTERN, data, re.DOTALL)]
    merges = []
    for r in range(44):
        counts: dict[tuple[int, int], int] = {}
        for w in words:
            for p in zip(w, w[1:]):
                counts[p] = counts.get(p, 0) + 1
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        words = [tk._merge_word(w, *best, 256 + r) or w for w in words]
    assert fast.merges == merges


def test_bpe_train_small_input_stops_early():
    t = BPETokenizer.train(b"abab", 1000)
    assert t.vocab_size < 1000 and t.decode(t.encode(b"ababab")) == b"ababab"
    assert BPETokenizer.train(b"", 300).vocab_size == 256
    with pytest.raises(ValueError, match=">= 256"):
        BPETokenizer.train(TEXT, 100)


def test_bpe_save_load(bpe, tmp_path):
    p = tmp_path / "tok.json"
    bpe.save(p)
    back = BPETokenizer.load(p)
    assert back.merges == bpe.merges and back.identity == bpe.identity and back.vocab_size == bpe.vocab_size
    assert back.encode(TEXT).tolist() == bpe.encode(TEXT).tolist()
    doc = json.loads(p.read_text())
    doc["merges"][3] = [doc["merges"][3][1], doc["merges"][3][0]]
    p.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="damaged|repeats"):
        BPETokenizer.load(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        BPETokenizer.load(p)
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a helios-bpe"):
        BPETokenizer.load(p)


def test_bpe_rejects_bad_ids(bpe):
    with pytest.raises(ValueError, match=r"\[0, 330\)"):
        bpe.decode([1, 330])
    with pytest.raises(ValueError):
        bpe.decode([-1])
    with pytest.raises(TypeError):
        bpe.decode(np.array([1.5]))
    with pytest.raises(TypeError):
        bpe.encode(12)  # type: ignore[arg-type]


def test_training_sample_is_deterministic_and_bounded():
    data = b"".join(b"line %d of the corpus\n" % i for i in range(50000))
    s1 = training_sample(data, 64 << 10)
    assert s1 == training_sample(data, 64 << 10)
    assert len(s1) <= (64 << 10) + 64
    assert s1.startswith(b"line 0 ")
    assert training_sample(b"small", 100) == b"small"


def test_get_tokenizer_specs(tmp_path):
    calls = []

    def corpus() -> bytes:
        calls.append(1)
        return TEXT

    assert isinstance(get_tokenizer("byte", corpus), ByteTokenizer)
    assert calls == []
    t1 = get_tokenizer("bpe:300", corpus, cache_dir_path=tmp_path, corpus_key="k1")
    assert t1.vocab_size == 300 and len(calls) == 1
    saved = list(tmp_path.iterdir())
    assert len(saved) == 1
    mtime = saved[0].stat().st_mtime_ns
    t2 = get_tokenizer("bpe:300", corpus, cache_dir_path=tmp_path, corpus_key="k1")
    assert t2.identity == t1.identity and len(calls) == 1  # reused: corpus not even read
    assert saved[0].stat().st_mtime_ns == mtime
    t3 = get_tokenizer("bpe:300", corpus, cache_dir_path=tmp_path)  # keyed by a hash of the sample
    assert t3.identity == t1.identity
    t4 = get_tokenizer(str(saved[0]), corpus)
    assert t4.identity == t1.identity
    for bad in ("bpe", "bpe:", "bpe:12", "bpe:x", "BYTE", "word", "missing.json"):
        with pytest.raises(ValueError, match="accepted forms"):
            get_tokenizer(bad, corpus, cache_dir_path=tmp_path)


def test_get_tokenizer_retrains_over_damaged_cache(tmp_path):
    t1 = get_tokenizer("bpe:280", lambda: TEXT, cache_dir_path=tmp_path, corpus_key="k")
    (f,) = tmp_path.iterdir()
    f.write_text("garbage")
    t2 = get_tokenizer("bpe:280", lambda: TEXT, cache_dir_path=tmp_path, corpus_key="k")
    assert t2.identity == t1.identity
    assert BPETokenizer.load(f).identity == t1.identity
