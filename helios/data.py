"""The training corpus, its token cache, the train/val split and the batch loader (numpy only).

Corpus
    With no ``--data``, the corpus is the Python standard library source of the
    interpreter running Helios: every ``*.py`` under
    ``sysconfig.get_paths()["stdlib"]``, excluding ``site-packages`` and
    ``dist-packages`` (third-party code that differs between machines) and the
    test folders ``test``, ``tests``, ``idle_test`` and ``__pycache__`` (several
    distributions ship the test suite separately, so leaving it out keeps the
    default corpus the same for the same Python version; it also holds files
    with deliberately broken encodings).  ``--data PATH`` takes one text file,
    or a folder: every regular file under it, in sorted relative-path order,
    skipping hidden files and folders (names starting with ".", e.g. ``.git``)
    and symlinks; a file whose first 8000 bytes hold a NUL byte is treated as
    binary and skipped (git's rule), and empty files add nothing.
    Documents are joined with ``b"\\n\\n"``.

Token cache
    Tokens are stored in ``<cache>/<corpus fingerprint>-<tokenizer identity>.tok``
    (default cache: ``$XDG_CACHE_HOME/helios/tokens`` or ``~/.cache/helios/tokens``,
    see :func:`helios.fileio.cache_dir`): a 64-byte header (magic
    ``HELIOSTK``, version, item size, token count, vocabulary size, SHA-256 of
    the token bytes) then the tokens as uint16 (vocabulary <= 65536) or uint32,
    written atomically and opened as a read-only memory map on later runs.
    Each document is tokenized on its own and the separator between documents
    is its own tokens, so document boundaries are token boundaries;
    ``tokenizer.decode(tokens) == corpus.read_bytes()``.

Split
    Validation is the last ``val_fraction`` (default 10%) of the token stream,
    training the rest: deterministic, contiguous (no window straddles both).
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sysconfig
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from helios.errors import DataError
from helios.fileio import atomic_open, cache_dir
from helios.tokenizer import BPETokenizer, ByteTokenizer, get_tokenizer

__all__ = [
    "Corpus",
    "open_corpus",
    "stdlib_files",
    "load_tokens",
    "token_dtype",
    "split_tokens",
    "BatchLoader",
    "unigram_entropy",
    "Dataset",
    "prepare_dataset",
]

SEPARATOR = b"\n\n"
_EXCLUDED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_BINARY_PROBE = 8000


def stdlib_files() -> list[Path]:
    """The default corpus: sorted ``*.py`` files of this interpreter's standard library (see module doc)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_STDLIB_DIRS]
        for name in filenames:
            p = Path(dirpath) / name
            if name.endswith(".py") and p.is_file() and not p.is_symlink():
                out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _folder_files(root: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            p = Path(dirpath) / name
            if not name.startswith(".") and not p.is_symlink() and p.is_file():
                out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _is_binary(head: bytes) -> bool:
    return b"\0" in head[:_BINARY_PROBE]


@dataclass
class Corpus:
    """An ordered list of text files read as one byte stream (documents joined by ``separator``).

    ``fingerprint`` hashes the file list with each file's size and mtime (no
    file is opened), so it changes when a file is added, removed or edited.
    ``skipped`` lists the files found to be binary by the last read.
    """

    root: Path
    files: list[Path]
    description: str
    separator: bytes = SEPARATOR
    skipped: list[Path] = field(default_factory=list)

    @property
    def fingerprint(self) -> str:
        """A 16-hex-digit key for caches derived from this corpus."""
        h = hashlib.sha256(b"helios-corpus-v1\0" + self.separator + b"\0" + os.fsencode(self.root))
        for p in self.files:
            st = p.stat()
            h.update(b"\0" + os.fsencode(p.relative_to(self.root).as_posix()))
            h.update(struct.pack("<qq", st.st_size, st.st_mtime_ns))
        return h.hexdigest()[:16]

    def documents(self) -> Iterator[bytes]:
        """Each non-binary, non-empty file's bytes, in order (updates ``skipped``)."""
        self.skipped = []
        for p in self.files:
            data = p.read_bytes()
            if _is_binary(data):
                self.skipped.append(p)
                continue
            if data:
                yield data

    def read_bytes(self) -> bytes:
        """The whole corpus as one byte string; ValueError if no text is left after skipping binaries."""
        data = self.separator.join(self.documents())
        if not data:
            raise DataError(
                f"corpus {self.description}: no text found ({len(self.files)} files, "
                f"{len(self.skipped)} skipped as binary); pass --data with a text file or folder"
            )
        return data

    def total_size(self) -> int:
        """Sum of the file sizes in bytes (from stat, not read)."""
        return sum(p.stat().st_size for p in self.files)


def open_corpus(data: str | os.PathLike[str] | None = None) -> Corpus:
    """The corpus for ``--data``: ``None`` for the standard library, else a file or folder path."""
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = stdlib_files()
        if not files:
            raise FileNotFoundError(f"no *.py files found under the standard library folder {str(root)!r}; "
                                    "pass --data PATH with a text file or folder")
        return Corpus(root, files, f"Python {sysconfig.get_python_version()} standard library ({root})")
    p = Path(data).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"--data {str(p)!r}: no such file or folder; pass a text file or a folder of text files"
        )
    if p.is_file():
        if p.stat().st_size == 0:
            raise DataError(f"--data {str(p)!r}: the file is empty; pass a file with text in it")
        return Corpus(p.parent, [p], str(p))
    if p.is_dir():
        files = _folder_files(p)
        if not files or all(f.stat().st_size == 0 for f in files):
            raise DataError(f"--data {str(p)!r}: the folder holds no non-empty regular files "
                             "(hidden files and symlinks are skipped); pass a folder of text files")
        return Corpus(p, files, str(p))
    raise DataError(f"--data {str(p)!r} is neither a regular file nor a folder")


# ---------------------------------------------------------------------------- token cache

_TOK_MAGIC = b"HELIOSTK"
_TOK_VERSION = 1
_TOK_HEADER = struct.Struct("<8sIIQQ32s")  # magic, version, itemsize, count, vocab_size, sha256
assert _TOK_HEADER.size == 64


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _tokenize(corpus: Corpus, tokenizer: Any, progress: bool) -> np.ndarray:
    dt = token_dtype(tokenizer.vocab_size)
    sep = tokenizer.encode(corpus.separator).astype(dt)
    parts: list[np.ndarray] = []
    files = corpus.documents()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=corpus.total_size(), desc="tokenize", unit="B", unit_scale=True)
    try:
        for doc in files:
            if parts:
                parts.append(sep)
            parts.append(tokenizer.encode(doc).astype(dt))
            if bar is not None:
                bar.update(len(doc))
    finally:
        if bar is not None:
            bar.close()
    if not parts:
        raise DataError(
            f"corpus {corpus.description}: no text found ({len(corpus.skipped)} files skipped as binary); "
            "pass --data with a text file or folder"
        )
    return np.concatenate(parts)


def _open_cached(path: Path, vocab_size: int, verify: bool) -> np.ndarray | None:
    """The memory-mapped tokens in ``path``, or None if absent or not a valid cache file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(_TOK_HEADER.size)
    except OSError:
        return None
    if len(raw) != _TOK_HEADER.size:
        return None
    magic, version, itemsize, count, vs, digest = _TOK_HEADER.unpack(raw)
    dt = token_dtype(vocab_size)
    if magic != _TOK_MAGIC or version != _TOK_VERSION or itemsize != dt.itemsize or vs != vocab_size:
        return None
    if size != _TOK_HEADER.size + count * itemsize or count == 0:
        return None
    mm = np.memmap(path, dtype=dt, mode="r", offset=_TOK_HEADER.size, shape=(count,))
    if verify and hashlib.sha256(mm).digest() != digest:
        return None
    return mm


def load_tokens(
    corpus: Corpus,
    tokenizer: Any,
    cache_dir_path: str | os.PathLike[str] | None = None,
    *,
    verify: bool = True,
    progress: bool = False,
) -> np.ndarray:
    """The corpus's tokens as a read-only memory map, tokenizing only on a cache miss.

    The cache key is ``corpus.fingerprint`` and ``tokenizer.identity``.  With
    ``verify`` the SHA-256 of the cached tokens is checked (a damaged cache
    file is re-created, never trusted).
    """
    d = cache_dir("tokens", cache_dir_path)
    path = d / f"{corpus.fingerprint}-{tokenizer.identity}.tok"
    mm = _open_cached(path, tokenizer.vocab_size, verify)
    if mm is not None:
        return mm
    toks = _tokenize(corpus, tokenizer, progress)
    header = _TOK_HEADER.pack(_TOK_MAGIC, _TOK_VERSION, toks.dtype.itemsize, toks.size, tokenizer.vocab_size,
                              hashlib.sha256(toks).digest())
    with atomic_open(path, "wb") as f:
        f.write(header)
        f.write(toks.data)
    mm = _open_cached(path, tokenizer.vocab_size, verify=False)
    if mm is None:  # the file we just wrote and fsynced must be readable
        raise OSError(f"token cache {str(path)!r} could not be read back after writing")
    return mm


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)``: val is the last ``val_fraction`` of ``tokens`` (at least one token), train the rest.

    Both are views (no copy); the split depends only on ``len(tokens)`` and ``val_fraction``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"split_tokens: val_fraction must lie in (0, 1), got {val_fraction!r}")
    n = len(tokens)
    if n < 2:
        raise ValueError(f"split_tokens: need at least 2 tokens to split, got {n}")
    n_val = min(n - 1, max(1, int(round(n * val_fraction))))
    return tokens[: n - n_val], tokens[n - n_val:]


# ---------------------------------------------------------------------------- batches


class BatchLoader:
    """Random (B, T) windows of a 1-D token array for next-token prediction.

    ``next_batch()`` returns ``(x, y)``, int64 arrays of shape
    ``(batch_size, block_size)`` with ``y[:, t] == x[:, t + 1]`` (``y`` is the
    same window shifted by one token).  Window starts are drawn uniformly from
    ``[0, len(tokens) - block_size - 1]`` by the loader's own PCG64 generator
    seeded with ``seed``; ``state_dict()`` captures that generator's exact
    state, so a loader restored with ``load_state_dict`` yields exactly the
    batches the uninterrupted one would have.
    """

    _STATE_VERSION = 1

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, seed: int = 0) -> None:
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            what = type(tokens).__name__
            if isinstance(tokens, np.ndarray):
                what += f" {tokens.dtype} of shape {tokens.shape}"
            raise ValueError(f"BatchLoader: tokens must be a 1-D integer numpy array, got {what}")
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"BatchLoader: batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise ValueError(f"BatchLoader: block_size must be an int >= 1, got {block_size!r}")
        if block_size >= len(tokens):
            raise ValueError(
                f"BatchLoader: block_size {block_size} needs at least {block_size + 1} tokens, the split has "
                f"{len(tokens)}; use a smaller --block-size, a smaller validation fraction or a larger corpus"
            )
        self.tokens = tokens
        self.batch_size = int(batch_size)
        self.block_size = int(block_size)
        self.seed = int(seed)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        self.batches_served = 0
        self._arange = np.arange(self.block_size + 1, dtype=np.int64)

    @property
    def n_windows(self) -> int:
        """How many distinct window starts exist."""
        return len(self.tokens) - self.block_size

    def _gather(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        win = np.asarray(self.tokens[starts[:, None] + self._arange], dtype=np.int64)
        return win[:, :-1], win[:, 1:]

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next random batch ``(x, y)``."""
        starts = self.rng.integers(0, self.n_windows, size=self.batch_size, dtype=np.int64)
        self.batches_served += 1
        return self._gather(starts)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        while True:
            yield self.next_batch()

    def iter_eval(self, batches: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``batches`` fixed batches with window starts spread evenly over the tokens.

        The same for every call and independent of the random state (it is not
        advanced), so validation losses of different steps and runs compare.
        """
        if batches < 1:
            raise ValueError(f"iter_eval: batches must be >= 1, got {batches}")
        n = batches * self.batch_size
        starts = np.linspace(0, self.n_windows - 1, n).round().astype(np.int64)
        for i in range(batches):
            yield self._gather(starts[i * self.batch_size:(i + 1) * self.batch_size])

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot of the position (store it in the checkpoint meta)."""
        return {
            "version": self._STATE_VERSION,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "block_size": self.block_size,
            "n_tokens": len(self.tokens),
            "batches_served": self.batches_served,
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position from :meth:`state_dict`; ValueError if it was made for other data or shapes."""
        if state.get("version") != self._STATE_VERSION:
            raise ValueError(f"BatchLoader.load_state_dict: state version {state.get('version')!r}, "
                             f"expected {self._STATE_VERSION}")
        mine = {"batch_size": self.batch_size, "block_size": self.block_size, "n_tokens": len(self.tokens)}
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"BatchLoader.load_state_dict: the saved loader differs ({detail}); resume "
                             "with the same data, tokenizer, batch size and block size, or start a new run")
        rng_state = state["rng"]
        if rng_state.get("bit_generator") != "PCG64":
            raise ValueError("BatchLoader.load_state_dict: expected a PCG64 state, got "
                             f"{rng_state.get('bit_generator')!r}")
        bg = np.random.PCG64()
        bg.state = rng_state
        self.rng = np.random.Generator(bg)
        self.seed = int(state["seed"])
        self.batches_served = int(state["batches_served"])


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats/token of the token frequencies in ``tokens``: ``-sum p log p``.

    This is the cross-entropy of the best model that ignores context (it
    predicts every position with the corpus's unigram distribution), so it is
    the baseline a language model's loss must get below to show it has learned
    anything from context; ``log(vocab_size)`` is the loss of a uniform guess,
    about where an untrained model starts.
    """
    t = np.asarray(tokens).reshape(-1)
    if t.size == 0:
        raise ValueError("unigram_entropy: no tokens")
    if t.dtype.kind not in "iu":
        raise ValueError(f"unigram_entropy: tokens must be integers, got {t.dtype}")
    if int(t.min()) < 0 or int(t.max()) >= vocab_size:
        raise ValueError(
            f"unigram_entropy: tokens must lie in [0, {vocab_size}), got [{int(t.min())}, {int(t.max())}]"
        )
    counts = np.bincount(t, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / t.size
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------- one call for the trainer


@dataclass
class Dataset:
    """Everything the training script needs: corpus, tokenizer and the split token streams."""

    corpus: Corpus
    tokenizer: ByteTokenizer | BPETokenizer
    tokens: np.ndarray
    train: np.ndarray
    val: np.ndarray

    def summary(self) -> dict[str, Any]:
        """Numbers worth logging at the start of a run."""
        return {
            "corpus": self.corpus.description,
            "files": len(self.corpus.files),
            "tokenizer": self.tokenizer.identity,
            "vocab_size": self.tokenizer.vocab_size,
            "tokens": len(self.tokens),
            "train_tokens": len(self.train),
            "val_tokens": len(self.val),
            "unigram_entropy_nats": unigram_entropy(self.train, self.tokenizer.vocab_size),
            "uniform_loss_nats": math.log(self.tokenizer.vocab_size),
        }


def prepare_dataset(
    data: str | os.PathLike[str] | None = None,
    tokenizer: str = "byte",
    *,
    cache_root: str | os.PathLike[str] | None = None,
    val_fraction: float = 0.1,
    progress: bool = False,
) -> Dataset:
    """Open the corpus (``--data``), build the tokenizer (``--tokenizer``), load or make the token
    cache, and split it.

    ``cache_root`` replaces the cache folder: tokens go to ``cache_root/tokens``
    and trained tokenizers to ``cache_root/tokenizers``.
    """
    corpus = open_corpus(data)
    root = Path(cache_root) if cache_root is not None else None
    tok = get_tokenizer(
        tokenizer,
        corpus.read_bytes,
        cache_dir_path=None if root is None else root / "tokenizers",
        corpus_key=corpus.fingerprint,
        progress=progress,
    )
    tokens = load_tokens(corpus, tok, None if root is None else root / "tokens", progress=progress)
    train, val = split_tokens(tokens, val_fraction)
    return Dataset(corpus, tok, tokens, train, val)
