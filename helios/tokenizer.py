"""Tokenizers for the training script: raw bytes, our own byte-level BPE, and a Hugging Face
``tokenizer.json`` (``hf:PATH``, through the ``tokenizers`` package).

The first two map any byte string to int32 token ids and back without loss:
``decode(encode(x)) == x`` for every ``bytes`` value, including invalid UTF-8,
NULs and the empty string.  A Hugging Face tokenizer decodes what its own
normalizer and decoder give back (for GPT-2's byte-level BPE that is the text
itself); bytes that are not UTF-8 are read with U+FFFD in their place.

Byte-level BPE
--------------
The base vocabulary is the 256 byte values; each merge adds one token (ids
256, 257, ... in merge order).  Before merging, the input is cut into chunks by
a regular expression (:data:`SPLIT_PATTERN`), so a token never spans two chunks:

* an optional leading space plus an identifier-like run (ASCII letters, ``_``,
  and bytes >= 0x80, so UTF-8 letters stay whole; digits allowed after the first
  byte), at most 64 bytes;
* an optional leading space plus 1-3 digits;
* an optional leading space plus a run of other bytes (punctuation, control
  bytes, NUL), at most 64;
* whitespace runs (the last space of a run before a word is left to that word),
  at most 64;
* the English contractions ``'s 't 're 've 'm 'll 'd``.

The length caps bound the cost of encoding one chunk, so pathological inputs
(megabytes of one letter) stay linear.  Every byte matches some branch, so the
chunks tile the input exactly.

Training counts each distinct chunk once (with its frequency), keeps pair
counts and a pair -> chunks index, and updates both incrementally after each
merge; the next merge is the most frequent pair, ties broken by the smallest
``(left id, right id)``, through a lazily invalidated heap.  Training is
therefore deterministic for a given input and vocabulary size.

Encoding splits the input into chunks, encodes each distinct chunk once
(lowest-rank merge first, which equals replaying the merges in order) and
caches it; long inputs are processed in blocks whose boundaries fall on chunk
boundaries, so the result equals encoding the whole input at once.
"""

from __future__ import annotations

import array
import hashlib
import heapq
import json
import os
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from helios.errors import DataError
from helios.fileio import atomic_write_bytes, cache_dir

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "BPETokenizer",
    "HFTokenizer",
    "SPLIT_PATTERN",
    "get_tokenizer",
    "training_sample",
]

SPLIT_PATTERN: bytes = (
    rb"'(?:[sdmt]|ll|ve|re)"
    rb"| ?[A-Za-z_\x80-\xff][A-Za-z0-9_\x80-\xff]{0,63}"
    rb"| ?[0-9]{1,3}"
    rb"| ?[^\sA-Za-z0-9_\x80-\xff]{1,64}"
    rb"|\s{1,64}(?!\S)"
    rb"|\s{1,64}"
)
# A match starting at s is decided by the bytes in [s, s + _LOOKAHEAD): a chunk
# that ends at least this far before a block's end is the same as in the whole input.
_LOOKAHEAD = 80
_BLOCK = 1 << 20
_MAX_CACHE = 1 << 20
_FORMAT = "helios-bpe"
_FORMAT_VERSION = 1


def _as_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"encode: expected bytes or str, got {type(data).__name__}")


def _as_ids(ids: object, vocab_size: int) -> np.ndarray:
    a = np.asarray(ids)
    if a.size == 0:
        return a.reshape(-1).astype(np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"decode: token ids must be integers, got dtype {a.dtype}")
    a = a.reshape(-1)
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"decode: token ids must lie in [0, {vocab_size}), got min {lo} max {hi}; "
            "were these ids made by a different tokenizer?"
        )
    return a


@runtime_checkable
class Tokenizer(Protocol):
    """What the training script needs from a tokenizer."""

    vocab_size: int
    identity: str

    def encode(self, data: bytes | str) -> np.ndarray: ...
    def decode(self, ids: object) -> bytes: ...
    def decode_text(self, ids: object) -> str: ...


class ByteTokenizer:
    """One token per byte: vocabulary 256, no training, the identity mapping."""

    vocab_size: int = 256
    identity: str = "byte"

    def encode(self, data: bytes | str) -> np.ndarray:
        """Token ids (int32) of ``data``; ``str`` is encoded as UTF-8 first."""
        return np.frombuffer(_as_bytes(data), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: object) -> bytes:
        """The bytes of token ids ``ids``."""
        return _as_ids(ids, 256).astype(np.uint8).tobytes()

    def decode_text(self, ids: object) -> str:
        """``decode`` as text, with invalid UTF-8 replaced by U+FFFD."""
        return self.decode(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _merge_word(word: list[int], a: int, b: int, new: int) -> list[int] | None:
    """``word`` with every non-overlapping (a, b), left to right, replaced by ``new``; None if absent."""
    out: list[int] = []
    i, n, hit = 0, len(word), False
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
            hit = True
        else:
            out.append(word[i])
            i += 1
    return out if hit else None


class BPETokenizer:
    """Byte-level BPE with a chunking pre-split (see the module docstring).

    Build one with :meth:`train` or :meth:`load`.  ``vocab_size`` is
    ``256 + len(merges)``; ``identity`` changes whenever the merges or the
    split pattern do (use it in cache keys).
    """

    def __init__(self, merges: list[tuple[int, int]], pattern: bytes = SPLIT_PATTERN) -> None:
        vocab: list[bytes] = [bytes([i]) for i in range(256)]
        ranks: dict[tuple[int, int], int] = {}
        for r, (a, b) in enumerate(merges):
            a, b = int(a), int(b)
            if not (0 <= a < len(vocab) and 0 <= b < len(vocab)):
                raise ValueError(f"BPETokenizer: merge {r} = ({a}, {b}) refers to a token not yet defined")
            if (a, b) in ranks:
                raise ValueError(f"BPETokenizer: merge {r} = ({a}, {b}) repeats merge {ranks[(a, b)]}")
            ranks[(a, b)] = r
            vocab.append(vocab[a] + vocab[b])
        self.merges: list[tuple[int, int]] = [(int(a), int(b)) for a, b in merges]
        self.pattern = pattern
        self._split = re.compile(pattern, re.DOTALL)
        self._ranks = ranks
        self._vocab = vocab
        self._vocab_flat: np.ndarray | None = None  # built on first decode
        self._vocab_len = self._vocab_off = np.zeros(0, np.int64)
        self.vocab_size: int = len(vocab)
        h = hashlib.sha256(pattern + b"\0" + json.dumps(self.merges, separators=(",", ":")).encode())
        self.identity: str = f"bpe{self.vocab_size}-{h.hexdigest()[:16]}"
        self._reset_cache()

    # ------------------------------------------------------------------ training

    @classmethod
    def train(cls, data: bytes | str, vocab_size: int, progress: bool = False) -> BPETokenizer:
        """Learn up to ``vocab_size - 256`` merges on ``data``, deterministically.

        Training stops early when no adjacent pair is left inside any chunk
        (tiny inputs), so the result may have fewer tokens than asked: read
        ``vocab_size`` of the result.  ``progress`` shows a tqdm bar.
        """
        if not isinstance(vocab_size, int) or vocab_size < 256:
            raise ValueError(f"BPETokenizer.train: vocab_size must be an int >= 256, got {vocab_size!r}")
        data = _as_bytes(data)
        split = re.compile(SPLIT_PATTERN, re.DOTALL)
        chunk_counts = Counter(split.findall(data))
        # Chunks of one byte contribute no pairs; drop them up front.
        words: list[list[int]] = []
        freqs: list[int] = []
        for chunk, c in chunk_counts.items():
            if len(chunk) > 1:
                words.append(list(chunk))
                freqs.append(c)
        counts: dict[tuple[int, int], int] = {}
        where: dict[tuple[int, int], set[int]] = {}
        for wi, (w, f) in enumerate(zip(words, freqs)):
            for p in zip(w, w[1:]):
                counts[p] = counts.get(p, 0) + f
                s = where.get(p)
                if s is None:
                    where[p] = {wi}
                else:
                    s.add(wi)
        heap = [(-c, p) for p, c in counts.items()]
        heapq.heapify(heap)

        n_merges = vocab_size - 256
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=n_merges, desc="bpe merges", unit="merge")
        merges: list[tuple[int, int]] = []
        try:
            while len(merges) < n_merges:
                best = None
                while heap:
                    negc, p = heapq.heappop(heap)
                    if counts.get(p, 0) == -negc:  # else stale: a fresher entry for p is in the heap
                        best = p
                        break
                if best is None:
                    break
                new = 256 + len(merges)
                merges.append(best)
                a, b = best
                touched: dict[tuple[int, int], int] = {}
                for wi in where.pop(best, ()):
                    w = words[wi]
                    nw = _merge_word(w, a, b, new)
                    if nw is None:  # stale index entry: an earlier merge removed the pair
                        continue
                    f = freqs[wi]
                    for p in zip(w, w[1:]):
                        touched[p] = touched.get(p, 0) - f
                    for p in zip(nw, nw[1:]):
                        touched[p] = touched.get(p, 0) + f
                        if p[0] == new or p[1] == new:
                            s = where.get(p)
                            if s is None:
                                where[p] = {wi}
                            else:
                                s.add(wi)
                    words[wi] = nw
                for p, d in touched.items():
                    if d == 0:
                        continue
                    c = counts.get(p, 0) + d
                    if c > 0:
                        counts[p] = c
                        heapq.heappush(heap, (-c, p))
                    else:
                        counts.pop(p, None)
                counts.pop(best, None)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return cls(merges)

    # ------------------------------------------------------------------ encoding

    def _reset_cache(self) -> None:
        self._chunk_id: dict[bytes, int] = {}
        self._flat = array.array("i")  # token ids of every cached chunk, back to back
        self._off = array.array("q")  # start of each cached chunk in _flat
        self._len = array.array("q")

    def _encode_chunk(self, chunk: bytes) -> list[int]:
        word = list(chunk)
        ranks = self._ranks
        while len(word) > 1:
            best_rank, best = None, None
            for p in zip(word, word[1:]):
                r = ranks.get(p)
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank, best = r, p
            if best is None:
                break
            word = _merge_word(word, best[0], best[1], 256 + best_rank)  # type: ignore[arg-type,operator]
        return word

    def _encode_chunks(self, chunks: list[bytes]) -> np.ndarray:
        if len(self._chunk_id) > _MAX_CACHE:
            self._reset_cache()
        cid = self._chunk_id
        ids = [cid.get(c, -1) for c in chunks]
        for i, c in enumerate(chunks):
            if ids[i] < 0:
                k = cid.get(c, -1)
                if k < 0:  # first time this chunk is seen
                    toks = self._encode_chunk(c)
                    k = len(self._off)
                    cid[c] = k
                    self._off.append(len(self._flat))
                    self._len.append(len(toks))
                    self._flat.extend(toks)
                ids[i] = k
        idx = np.asarray(ids, dtype=np.int64)
        flat = np.frombuffer(self._flat, dtype=np.int32) if len(self._flat) else np.zeros(0, np.int32)
        lens = np.frombuffer(self._len, dtype=np.int64)[idx]
        starts = np.frombuffer(self._off, dtype=np.int64)[idx]
        total = int(lens.sum())
        # Gather index: for output position j in chunk i, starts[i] + (j - first output pos of chunk i).
        shift = starts - (np.cumsum(lens) - lens)
        gather = np.repeat(shift, lens) + np.arange(total, dtype=np.int64)
        return flat[gather]

    def encode(self, data: bytes | str) -> np.ndarray:
        """Token ids (int32) of ``data`` (``str`` is encoded as UTF-8)."""
        data = _as_bytes(data)
        n = len(data)
        parts: list[np.ndarray] = []
        pos = 0
        split = self._split
        while pos < n:
            end = min(n, pos + max(_BLOCK, 2 * _LOOKAHEAD))  # a block always holds a whole chunk
            if end == n:
                chunks = split.findall(data, pos)
                nxt = n
            else:
                chunks = []
                nxt = pos
                for m in split.finditer(data, pos, end):
                    if m.end() > end - _LOOKAHEAD:
                        break  # this and later chunks may differ from whole-input chunking
                    chunks.append(m.group())
                    nxt = m.end()
                if nxt == pos:  # cannot happen: chunks are <= 66 bytes; guard against an endless loop
                    raise AssertionError("BPETokenizer.encode: no progress in block split")
            parts.append(self._encode_chunks(chunks))
            pos = nxt
        if not parts:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(parts).astype(np.int32, copy=False)

    def decode(self, ids: object) -> bytes:
        """The bytes of token ids ``ids``."""
        a = _as_ids(ids, self.vocab_size)
        if self._vocab_flat is None:
            self._vocab_flat = np.frombuffer(b"".join(self._vocab), dtype=np.uint8)
            self._vocab_len = np.array([len(v) for v in self._vocab], dtype=np.int64)
            self._vocab_off = np.cumsum(self._vocab_len) - self._vocab_len
        lens = self._vocab_len[a]
        shift = self._vocab_off[a] - (np.cumsum(lens) - lens)
        gather = np.repeat(shift, lens) + np.arange(int(lens.sum()), dtype=np.int64)
        return self._vocab_flat[gather].tobytes()

    def decode_text(self, ids: object) -> str:
        """``decode`` as text, with invalid UTF-8 replaced by U+FFFD."""
        return self.decode(ids).decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for."""
        return self._vocab[i]

    # ------------------------------------------------------------------ persistence

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the tokenizer as JSON (atomically)."""
        doc = {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "vocab_size": self.vocab_size,
            "identity": self.identity,
            "pattern": self.pattern.decode("latin-1"),
            "merges": [list(m) for m in self.merges],
        }
        atomic_write_bytes(path, json.dumps(doc, indent=0).encode("utf-8"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BPETokenizer:
        """Read a tokenizer written by :meth:`save`; ValueError naming the file if it is not one."""
        p = Path(path)
        try:
            doc = json.loads(p.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"BPETokenizer.load: {str(p)!r} is not valid JSON ({e}); delete it to retrain"
            ) from e
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError(f"BPETokenizer.load: {str(p)!r} is not a {_FORMAT} file; delete it to retrain")
        if doc.get("version") != _FORMAT_VERSION:
            raise ValueError(
                f"BPETokenizer.load: {str(p)!r} has format version {doc.get('version')!r}, "
                f"expected {_FORMAT_VERSION}; delete it to retrain"
            )
        tok = cls([tuple(m) for m in doc["merges"]], doc["pattern"].encode("latin-1"))
        if doc.get("identity") not in (None, tok.identity):
            raise ValueError(f"BPETokenizer.load: {str(p)!r} is damaged (identity does not match its "
                             "merges); delete it to retrain")
        return tok

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, identity={self.identity!r})"


# ---------------------------------------------------------------------- Hugging Face tokenizer.json


def hf_tokenizer_file(path: str | os.PathLike[str]) -> Path:
    """The ``tokenizer.json`` that ``hf:PATH`` names: the file itself, or ``PATH/tokenizer.json``."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    return p


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` run by the ``tokenizers`` package (``--tokenizer hf:PATH``).

    ``PATH`` is the file or the folder holding it (a model folder).  Text is encoded without
    the tokenizer's special tokens (documents are joined by the corpus's separator, as with the
    other tokenizers); ``vocab_size`` is one more than the largest id of the vocabulary,
    added tokens included; ``identity`` hashes the file's bytes, so a changed tokenizer is a
    new token cache and a run refuses to resume with it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = hf_tokenizer_file(path)
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise DataError("--tokenizer hf: needs the tokenizers package: pip install tokenizers") from None
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise DataError(f"--tokenizer hf:{path}: cannot read {str(p)!r} ({e.strerror or e}); pass a "
                            "tokenizer.json or the folder holding one") from None
        try:
            self._tok = _Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the package raises its own Exception for any malformed file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"--tokenizer hf:{path}: {str(p)!r} is not a tokenizers tokenizer.json ({first})") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.path = p
        self.vocab_size: int = max(vocab.values()) + 1 if vocab else 0
        if self.vocab_size < 1:
            raise DataError(f"--tokenizer hf:{path}: {str(p)!r} has an empty vocabulary")
        self.identity: str = f"hf{self.vocab_size}-{hashlib.sha256(raw).hexdigest()[:16]}"

    @staticmethod
    def _text(data: bytes | str) -> str:
        if isinstance(data, str):
            return data
        return _as_bytes(data).decode("utf-8", errors="replace")

    def encode(self, data: bytes | str) -> np.ndarray:
        """Token ids (int32) of ``data`` (bytes are read as UTF-8), without special tokens."""
        ids = self._tok.encode(self._text(data), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def encode_batch(self, docs: list[bytes | str]) -> list[np.ndarray]:
        """``encode`` of each document, run in parallel by the tokenizers package."""
        encs = self._tok.encode_batch([self._text(d) for d in docs], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids: object) -> bytes:
        """The UTF-8 bytes of the text the tokenizer decodes ``ids`` to (special tokens kept)."""
        a = _as_ids(ids, self.vocab_size)
        return self._tok.decode(a.tolist(), skip_special_tokens=False).encode("utf-8")

    def decode_text(self, ids: object) -> str:
        """``decode`` as text."""
        return self.decode(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------- spec -> tokenizer

_SPEC_HELP = (
    "'byte', 'bpe:N' (train or reuse a byte-level BPE with vocabulary N >= 256), "
    "'hf:PATH' (a Hugging Face tokenizer.json, or the folder holding one), or a path to a saved BPE .json"
)


def training_sample(data: bytes, max_bytes: int = 4 << 20, windows: int = 64) -> bytes:
    """A deterministic sample of at most about ``max_bytes`` of ``data`` for tokenizer training.

    ``data`` itself when small enough; else ``windows`` equally spaced slices,
    each started just after a newline so that lines are not cut at the front.
    """
    if len(data) <= max_bytes:
        return data
    w = max_bytes // windows
    out = []
    for i in range(windows):
        start = i * (len(data) - w) // (windows - 1)
        nl = data.find(b"\n", start, start + w) if start > 0 else -1
        s = nl + 1 if nl >= 0 else start
        out.append(data[s:start + w])
    return b"\n".join(out)


def get_tokenizer(
    spec: str,
    corpus_bytes_fn: Callable[[], bytes] | None = None,
    *,
    cache_dir_path: str | os.PathLike[str] | None = None,
    corpus_key: str | None = None,
    sample_bytes: int = 4 << 20,
    progress: bool = False,
) -> ByteTokenizer | BPETokenizer | HFTokenizer:
    """Build the tokenizer named by ``spec`` (see ``_SPEC_HELP``).

    For ``bpe:N`` a tokenizer saved under the tokenizer cache
    (:func:`helios.fileio.cache_dir` ``("tokenizers")`` unless
    ``cache_dir_path``) is reused when one exists for this N and corpus: the
    key is ``corpus_key`` when given (e.g. the corpus fingerprint, so the corpus
    is not read at all on a hit), else a hash of the training sample.
    Otherwise one is trained on :func:`training_sample` of
    ``corpus_bytes_fn()`` and saved.
    """
    check_spec(spec)
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        n = int(spec[4:])
        if corpus_bytes_fn is None:
            raise ValueError(f"tokenizer spec {spec!r} needs a corpus to train on (corpus_bytes_fn)")
        d = cache_dir("tokenizers", cache_dir_path)
        sample = None
        if corpus_key is None:
            sample = training_sample(corpus_bytes_fn(), sample_bytes)
            corpus_key = hashlib.sha256(sample).hexdigest()[:16]
        path = d / f"bpe{n}-{corpus_key}-s{sample_bytes}.json"
        if path.exists():
            try:
                return BPETokenizer.load(path)
            except ValueError:
                pass  # damaged or old cache entry: retrain and overwrite it
        if sample is None:
            sample = training_sample(corpus_bytes_fn(), sample_bytes)
        tok = BPETokenizer.train(sample, n, progress=progress)
        tok.save(path)
        return tok
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:])
    return BPETokenizer.load(spec)


def check_spec(spec) -> None:
    """Raise DataError naming what is wrong with a --tokenizer spec (nothing is built or read)."""
    if not isinstance(spec, str):
        raise DataError(f"--tokenizer must be a string: {_SPEC_HELP}; got {spec!r}")
    if spec == "byte":
        return
    if spec.startswith("bpe:"):
        if not spec[4:].isdigit() or int(spec[4:]) < 256:
            raise DataError(f"--tokenizer {spec}: N must be an integer >= 256; accepted forms: {_SPEC_HELP}")
        return
    if spec.startswith("hf:"):
        p = hf_tokenizer_file(spec[3:])
        if not spec[3:] or not p.is_file():
            what = "no tokenizer.json in that folder" if Path(spec[3:]).expanduser().is_dir() else "no such file"
            raise DataError(f"--tokenizer {spec}: {what}; pass hf: with a Hugging Face tokenizer.json or the "
                            "folder holding one")
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise DataError(f"--tokenizer {spec} needs the tokenizers package: pip install tokenizers") from None
        return
    if spec.endswith(".json") and os.path.exists(spec):
        return
    raise DataError(f"--tokenizer {spec}: unknown tokenizer spec; accepted forms: {_SPEC_HELP}")


def normalize_spec(spec: str) -> str:
    """``spec`` as a run saves it: ``hf:PATH`` with an absolute path (a resumed run may start
    elsewhere); other specs unchanged."""
    if isinstance(spec, str) and spec.startswith("hf:") and spec[3:]:
        return "hf:" + os.path.abspath(os.path.expanduser(spec[3:]))
    return spec
