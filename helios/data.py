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
    A path ending in ``.jsonl`` (or a folder or glob of them) is JSON lines: one
    object per line, each with a string ``text`` field, each record a document
    (blank lines skipped; a malformed line is refused naming the file, line and
    byte).  A glob (``"notes/*.txt"``) is the sorted files it matches.

Token shards
    A ``.bin`` file (or a glob of them, or a folder holding only ``.bin`` files)
    is already tokenized: llm.c's shards (a header of 256 int32: magic 20240520,
    version 1, token count, then the tokens as uint16; llm.c's LLaMA-3 shards,
    magic 20240801 version 7, hold uint32) or nanoGPT's raw uint16 ``.bin``
    (``train.bin`` / ``val.bin``: no header).  The two are told apart by the
    magic: a file whose first int32 is a known magic is llm.c's.  Shards are
    memory-mapped, never read whole; a header or size that does not add up is
    refused naming the file and the byte (:class:`~helios.errors.DataError`).
    Their largest token id must fit the tokenizer's vocabulary (scanned once per
    shard set and cached beside the token cache).

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
    Text: validation is the last ``val_fraction`` (default 10%) of the token
    stream, training the rest: deterministic, contiguous (no window straddles
    both).  Token shards: the files named as validation (a ``val``, ``valid`` or
    ``validation`` part in the name, delimited by ``_ - .`` or the ends:
    nanoGPT's ``val.bin``, llm.c's ``*_val_*.bin``) are the validation set when
    ``--data`` names them (a glob or folder holding both) or when they lie
    beside the training files: ``train.bin`` -> ``val.bin``,
    ``fineweb_train_*.bin`` -> ``fineweb_val_*.bin`` (the ``train`` part of the
    name replaced by ``val``).  With no such files the last ``val_fraction`` of
    the training tokens is the validation set, as for text.  A window never
    straddles two shards.
"""

from __future__ import annotations

import functools
import glob as _glob
import hashlib
import json
import math
import os
import re
import struct
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from helios.errors import DataError
from helios.fileio import atomic_open, atomic_write_bytes, cache_dir
from helios.tokenizer import BPETokenizer, ByteTokenizer, HFTokenizer, get_tokenizer

__all__ = [
    "Corpus",
    "open_corpus",
    "open_data",
    "Shard",
    "ShardSet",
    "read_shard",
    "write_shard",
    "TokenStream",
    "check_token_data",
    "shard_tokenizer",
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


def _relative_posix(path: Path, root: Path) -> str:
    """``path.relative_to(root).as_posix()``, by string slicing where ``path`` names a file under
    ``root`` as it is spelled (the usual case; pathlib's own way costs ~10 us a path, and a
    corpus's file list is walked for every fingerprint)."""
    s, prefix = str(path), str(root).rstrip("/") + "/"
    if s.startswith(prefix) and os.sep == "/":
        return s[len(prefix):]
    return path.relative_to(root).as_posix()


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
    return sorted(out, key=lambda p: _relative_posix(p, root))


def _folder_files(root: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            p = Path(dirpath) / name
            if not name.startswith(".") and not p.is_symlink() and p.is_file():
                out.append(p)
    return sorted(out, key=lambda p: _relative_posix(p, root))


def _is_binary(head: bytes) -> bool:
    return b"\0" in head[:_BINARY_PROBE]


@dataclass
class Corpus:
    """An ordered list of text files read as one byte stream (documents joined by ``separator``).

    ``fingerprint`` hashes the file list with each file's size and mtime (no
    file is opened), so a corpus opened after a file is added, removed or edited has another.
    ``skipped`` lists the files found to be binary by the last read.  ``kind``
    ``"jsonl"``: each file holds JSON lines, and each line's ``text`` is a document.
    """

    root: Path
    files: list[Path]
    description: str
    separator: bytes = SEPARATOR
    skipped: list[Path] = field(default_factory=list)
    kind: str = "text"  # "text" | "jsonl"

    @functools.cached_property
    def fingerprint(self) -> str:
        """A 16-hex-digit key for caches derived from this corpus: the files as they were when it was
        first asked for (one walk of stat calls; the token cache's name, the trainer's data key and the
        checkpoint's record then name the same state)."""
        h = hashlib.sha256(b"helios-corpus-v1\0" + self.separator + b"\0" + os.fsencode(self.root))
        if self.kind != "text":  # (text corpora keep the key they always had)
            h.update(b"\0kind=" + self.kind.encode())
        for p in self.files:
            st = os.stat(p)
            h.update(b"\0" + os.fsencode(_relative_posix(p, self.root)))
            h.update(struct.pack("<qq", st.st_size, st.st_mtime_ns))
        return h.hexdigest()[:16]

    def documents(self) -> Iterator[bytes]:
        """Each non-binary, non-empty file's bytes, in order (updates ``skipped``); for JSON lines,
        each record's ``text`` as UTF-8."""
        self.skipped = []
        if self.kind == "jsonl":
            for p in self.files:
                yield from jsonl_texts(p)
            return
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
            raise self.no_text_error()
        return data

    def no_text_error(self) -> DataError:
        """The error of a corpus that gave no text, after :meth:`documents` read it."""
        if self.kind == "jsonl":
            return DataError(f"corpus {self.description}: no text found (every record's \"text\" is empty); "
                             "pass --data with JSON lines holding text")
        return DataError(f"corpus {self.description}: no text found ({len(self.files)} files, {len(self.skipped)} "
                         "skipped as binary); pass --data with a text file or folder")

    def total_size(self) -> int:
        """Sum of the file sizes in bytes (from stat, not read)."""
        return sum(p.stat().st_size for p in self.files)


def jsonl_texts(path: Path) -> Iterator[bytes]:
    """The ``text`` of each record of a JSON-lines file, as UTF-8 (blank lines and empty texts
    add nothing); a line that is not a JSON object with a string ``text`` is refused in one line
    naming the file, the line and its byte offset."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            at, offset = offset, offset + len(line)
            if not line.strip():
                continue
            where = f"{str(path)!r} line {lineno} (byte {at})"
            try:
                rec = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                why = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                raise DataError(f"--data {where}: not a JSON line ({why}); a .jsonl file holds one JSON object "
                                "per line, each with a \"text\" field") from None
            if not isinstance(rec, dict) or "text" not in rec:
                got = f"fields {', '.join(map(repr, list(rec)[:5]))}" if isinstance(rec, dict) else type(rec).__name__
                raise DataError(f"--data {where}: no \"text\" field ({got}); a .jsonl file holds one JSON object "
                                "per line, each with a \"text\" field")
            text = rec["text"]
            if not isinstance(text, str):
                raise DataError(f"--data {where}: \"text\" is {type(text).__name__}, expected a string")
            if text:
                yield text.encode("utf-8", errors="surrogatepass")


def _is_glob(data: str) -> bool:
    return any(c in data for c in "*?[") and not os.path.exists(data)


def _glob_files(pattern: str) -> list[Path]:
    """The regular files a glob matches, sorted (hidden names only when the pattern names them)."""
    return sorted(Path(m) for m in _glob.glob(os.path.expanduser(pattern)) if os.path.isfile(m))


def _kind_of(files: Sequence[Path]) -> str:
    """``"bin"`` when every file is a ``.bin`` (token shards), ``"jsonl"`` when every file is JSON
    lines, else ``"text"``."""
    for kind, ext in (("bin", ".bin"), ("jsonl", ".jsonl")):
        if files and all(f.name.lower().endswith(ext) for f in files):
            return kind
    return "text"


def open_data(data: str | os.PathLike[str] | None = None) -> Corpus | ShardSet:
    """What ``--data`` names: a :class:`Corpus` (text or JSON lines) or a :class:`ShardSet` (token
    shards: ``.bin`` files).  A file, a folder or a glob; see the module doc.  The shards' headers
    are checked here (cheap: one read of 1 KiB per file); nothing else is read."""
    if data is None:
        return open_corpus(None)
    spec = os.fspath(data)
    if _is_glob(spec):
        files = _glob_files(spec)
        if not files:
            raise FileNotFoundError(f"--data {spec!r}: the pattern matches no file; pass a file, a folder or a "
                                    "glob that matches files")
        kind = _kind_of(files)
        if kind == "bin":
            return open_shards(spec, files)
        if any(f.name.lower().endswith(".bin") for f in files):
            raise DataError(f"--data {spec!r} matches token shards (.bin) and other files; a glob names token "
                            "shards only, or text / JSON lines only")
        root = Path(os.path.commonpath([str(f.parent) for f in files]))
        return Corpus(root, files, spec, kind=kind)
    p = Path(spec).expanduser()
    if p.is_file() and p.name.lower().endswith(".bin"):
        return open_shards(spec, [p])
    if p.is_dir():
        files = _folder_files(p)
        if files and _kind_of(files) == "bin":
            return open_shards(spec, files)
    return open_corpus(spec)


def open_corpus(data: str | os.PathLike[str] | None = None) -> Corpus:
    """The corpus for ``--data``: ``None`` for the standard library, else a file or folder path
    (of text, or of JSON lines when the file / every file of the folder ends in ``.jsonl``)."""
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
        return Corpus(p.parent, [p], str(p), kind="jsonl" if _kind_of([p]) == "jsonl" else "text")
    if p.is_dir():
        files = _folder_files(p)
        if not files or all(f.stat().st_size == 0 for f in files):
            raise DataError(f"--data {str(p)!r}: the folder holds no non-empty regular files "
                             "(hidden files and symlinks are skipped); pass a folder of text files")
        return Corpus(p, files, str(p), kind="jsonl" if _kind_of(files) == "jsonl" else "text")
    raise DataError(f"--data {str(p)!r} is neither a regular file nor a folder")


# ---------------------------------------------------------------------------- token shards

LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = 4 * LLMC_HEADER_INTS
# magic -> (version, token dtype, what): llm.c's dev/data/data_common.py HEADERS_INFO
LLMC_FORMATS: dict[int, tuple[int, np.dtype, str]] = {
    20240520: (1, np.dtype("<u2"), "llm.c"),
    20240801: (7, np.dtype("<u4"), "llm.c LLaMA-3"),
}
RAW_DTYPE = np.dtype("<u2")
_MAX_OPEN_SHARDS = 64  # memory maps kept open at once (each holds a file descriptor)


@dataclass(frozen=True)
class Shard:
    """One file of tokens: where its tokens start, how many, their dtype.

    ``kind`` is ``"llm.c"`` / ``"llm.c LLaMA-3"`` (header of 256 int32) or ``"nanoGPT"`` (raw
    uint16, no header).  ``tokens()`` memory-maps them read-only (never read whole).
    """

    path: Path
    kind: str
    offset: int  # byte offset of the first token
    count: int
    dtype: np.dtype
    size: int  # the file's size in bytes when opened
    mtime_ns: int

    def tokens(self) -> np.ndarray:
        """The tokens, memory-mapped (at most a few dozen shards are mapped at once)."""
        return _mapped(self)


@functools.lru_cache(maxsize=_MAX_OPEN_SHARDS)
def _mapped(shard: Shard) -> np.ndarray:
    try:
        return np.memmap(shard.path, dtype=shard.dtype, mode="r", offset=shard.offset, shape=(shard.count,))
    except (OSError, ValueError) as e:
        raise DataError(f"--data {str(shard.path)!r}: cannot map the shard's tokens ({e})") from None


def read_shard(path: str | os.PathLike[str]) -> Shard:
    """Open a token shard: llm.c's (by its magic) or nanoGPT's raw uint16 (without one).

    A header or a size that does not add up is refused with one :class:`DataError` line naming
    the file and the byte where it goes wrong; only the first 1 KiB is read.
    """
    p = Path(path)
    try:
        st = p.stat()
        with open(p, "rb") as f:
            head = f.read(LLMC_HEADER_BYTES)
    except OSError as e:
        raise DataError(f"--data {str(p)!r}: cannot read the shard ({e.strerror or e})") from None
    size, name = st.st_size, repr(str(p))
    if size == 0:
        raise DataError(f"--data {name}: the file is empty (0 bytes); a token shard holds at least one token")
    magic = struct.unpack_from("<i", head)[0] if len(head) >= 4 else None
    if magic in LLMC_FORMATS:
        version, dtype, what = LLMC_FORMATS[magic]
        if size < LLMC_HEADER_BYTES:
            raise DataError(f"--data {name}: {what} shard header truncated at byte {size}: the header is 256 int32 "
                            f"({LLMC_HEADER_BYTES} bytes; magic {magic} at byte 0)")
        hdr = np.frombuffer(head, dtype="<i4")
        if int(hdr[1]) != version:
            raise DataError(f"--data {name}: byte 4: {what} header version {int(hdr[1])}, expected {version} "
                            f"({dtype.itemsize * 8}-bit tokens) after magic {magic}; the header is damaged or "
                            "of another format")
        count = int(hdr[2])
        if count <= 0:
            raise DataError(f"--data {name}: byte 8: token count {count} in the {what} header; a shard holds at "
                            "least one token")
        end = LLMC_HEADER_BYTES + count * dtype.itemsize
        if size < end:
            raise DataError(f"--data {name}: truncated at byte {size}: the {what} header (byte 8) counts {count} "
                            f"tokens, which end at byte {end}")
        if size > end:
            raise DataError(f"--data {name}: {size - end} extra bytes from byte {end}: the {what} header (byte 8) "
                            f"counts {count} tokens, which end there")
        return Shard(p, what, LLMC_HEADER_BYTES, count, dtype, size, st.st_mtime_ns)
    if size >= LLMC_HEADER_BYTES:
        # The rest of an llm.c header (version, a count that matches the size) behind a wrong magic:
        # a damaged shard, not raw tokens that happen to look so.
        hdr = np.frombuffer(head, dtype="<i4")
        for m, (version, dtype, what) in LLMC_FORMATS.items():
            if int(hdr[1]) == version and int(hdr[2]) > 0 and size == LLMC_HEADER_BYTES + int(hdr[2]) * dtype.itemsize:
                raise DataError(f"--data {name}: byte 0: magic {magic}, expected {m}: the rest of the header is "
                                f"{what}'s (version {version}, {int(hdr[2])} tokens), the magic is damaged")
    if size % RAW_DTYPE.itemsize:
        raise DataError(f"--data {name}: {size} bytes, an odd count: without an llm.c header (its first int32 is "
                        f"not {', '.join(map(str, LLMC_FORMATS))}) a .bin is nanoGPT's raw uint16 tokens, 2 bytes "
                        f"each, and the last one is cut at byte {size - 1}")
    return Shard(p, "nanoGPT", 0, size // RAW_DTYPE.itemsize, RAW_DTYPE, size, st.st_mtime_ns)


def write_shard(path: str | os.PathLike[str], tokens: np.ndarray, kind: str = "llm.c") -> None:
    """Write ``tokens`` as an llm.c shard (``kind="llm.c"``: the 256-int32 header, uint16 tokens;
    ``"llm.c LLaMA-3"``: uint32 tokens) or as nanoGPT's raw uint16 ``.bin`` (``"nanoGPT"``),
    atomically."""
    t = np.asarray(tokens).reshape(-1)
    if t.dtype.kind not in "iu" or (t.size and (int(t.min()) < 0)):
        raise ValueError(f"write_shard: tokens must be non-negative integers, got {t.dtype}")
    if kind == "nanoGPT":
        dtype, header = RAW_DTYPE, b""
    else:
        found = [(m, v, dt) for m, (v, dt, what) in LLMC_FORMATS.items() if what == kind]
        if not found:
            raise ValueError(f"write_shard: kind must be 'nanoGPT' or one of {[w for _, _, w in LLMC_FORMATS.values()]}, "
                             f"got {kind!r}")
        magic, version, dtype = found[0]
        hdr = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
        hdr[:3] = (magic, version, t.size)
        header = hdr.tobytes()
    if t.size and int(t.max()) > np.iinfo(dtype).max:
        raise ValueError(f"write_shard: token {int(t.max())} does not fit {kind}'s {dtype.itemsize * 8}-bit tokens")
    atomic_write_bytes(path, header + t.astype(dtype).tobytes())


_VAL_PART = re.compile(r"(?:^|[_\-.])(?:val|valid|validation)(?=[_\-.]|$)", re.IGNORECASE)
_TRAIN_PART = re.compile(r"(^|[_\-.])train(?=[_\-.]|$)", re.IGNORECASE)


def _is_val_name(p: Path) -> bool:
    return _VAL_PART.search(p.name) is not None


@dataclass
class ShardSet:
    """Token shards named by ``--data``: the training shards and, when found, the validation ones
    (see the module doc's Split).  Duck-types the parts of :class:`Corpus` the trainer reads
    (``description``, ``files``, ``fingerprint``)."""

    spec: str
    train_shards: list[Shard]
    val_shards: list[Shard]
    val_rule: str | None  # how the validation files were found (None: none, the last val_fraction)
    val_fraction: float = 0.1  # with no validation files: this last part of the training tokens

    @property
    def files(self) -> list[Path]:
        return [s.path for s in self.train_shards + self.val_shards]

    @property
    def kinds(self) -> str:
        return " + ".join(sorted({s.kind for s in self.train_shards + self.val_shards}))

    @property
    def validation(self) -> str:
        """Where the validation set comes from, in words."""
        return self.val_rule or f"the last {self.val_fraction:.0%} of the tokens, no *val* file found"

    @property
    def description(self) -> str:
        n = len(self.train_shards)
        what = f"{n} {self.kinds} shards" if n > 1 else f"{self.kinds} tokens"
        return f"{what} {self.spec} (validation: {self.validation})"

    @property
    def fingerprint(self) -> str:
        """A 16-hex-digit key: every shard's path, size and mtime, and its role."""
        h = hashlib.sha256(b"helios-shards-v1")
        for role, shards in (("train", self.train_shards), ("val", self.val_shards)):
            for s in shards:
                h.update(f"\0{role}\0".encode() + os.fsencode(s.path.resolve()))
                h.update(struct.pack("<qq", s.size, s.mtime_ns))
        return h.hexdigest()[:16]

    def streams(self) -> tuple[TokenStream, TokenStream]:
        """``(train, val)`` token streams: the validation shards, or the last ``val_fraction`` of
        the training tokens when there are none."""
        train = TokenStream(self.train_shards)
        if self.val_shards:
            return train, TokenStream(self.val_shards)
        return split_tokens(train, self.val_fraction)

    def max_token(self, cache_dir_path: str | os.PathLike[str] | None = None,
                  progress: bool = False) -> tuple[int, Shard, int]:
        """The largest token id in any shard, the shard holding it and its index there; scanned in
        chunks of the memory maps once, then read from a small cache file keyed by the
        fingerprint."""
        shards = self.train_shards + self.val_shards
        path = cache_dir("tokens", cache_dir_path) / f"{self.fingerprint}-max.json"
        try:
            found = json.loads(path.read_text())
            if len(found) == len(shards):
                k = max(range(len(shards)), key=lambda i: found[i][0])
                return int(found[k][0]), shards[k], int(found[k][1])
        except (OSError, ValueError, TypeError, IndexError, KeyError):
            pass
        bar = None
        total = sum(s.count for s in shards)
        if progress and total >= 1 << 27:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="scan shards", unit="tok", unit_scale=True)
        out = []
        try:
            for s in shards:
                mm = np.memmap(s.path, dtype=s.dtype, mode="r", offset=s.offset, shape=(s.count,))
                best, at = -1, 0
                for i in range(0, s.count, 1 << 24):
                    chunk = mm[i:i + (1 << 24)]
                    m = int(chunk.max())
                    if m > best:
                        best, at = m, i + int(chunk.argmax())
                    if bar is not None:
                        bar.update(len(chunk))
                del mm
                out.append([best, at])
        finally:
            if bar is not None:
                bar.close()
        try:
            atomic_write_bytes(path, json.dumps(out).encode())
        except OSError:
            pass  # a read-only cache: scan again next time
        k = max(range(len(shards)), key=lambda i: out[i][0])
        return out[k][0], shards[k], out[k][1]


def _siblings(spec: str, train: list[Path]) -> list[Path]:
    """The validation files beside the training ones: the ``train`` part of the file name (or
    of the glob's last component) replaced by ``val``."""
    if _is_glob(spec):
        folder, base = os.path.split(os.path.expanduser(spec))
        if _TRAIN_PART.search(base) is None:
            return []
        return [f for f in _glob_files(os.path.join(folder, _TRAIN_PART.sub(r"\1val", base))) if f not in train]
    if len(train) == 1 and Path(os.path.expanduser(spec)).is_file():
        p = train[0]
        if _TRAIN_PART.search(p.name) is None:
            return []
        v = p.with_name(_TRAIN_PART.sub(r"\1val", p.name))
        return [v] if v.is_file() else []
    return []


def open_shards(spec: str, files: list[Path]) -> ShardSet:
    """The :class:`ShardSet` of ``files`` (what ``spec`` named), each header checked."""
    val_named = [f for f in files if _is_val_name(f)]
    train_files = [f for f in files if not _is_val_name(f)]
    if val_named and not train_files:
        raise DataError(f"--data {spec!r} names only validation shards ({', '.join(f.name for f in val_named[:3])}: "
                        "'val' in the name); pass the training shards (the validation ones beside them are found)")
    val_files = val_named or _siblings(spec, train_files)
    rule = None
    if val_files:
        rule = val_files[0].name if len(val_files) == 1 else f"{len(val_files)} files like {val_files[0].name}"
        rule += ", named *val*" if val_named else ", beside the training files"
    return ShardSet(spec, [read_shard(f) for f in train_files], [read_shard(f) for f in val_files], rule)


class TokenStream:
    """Token arrays read as one stream without concatenating them: the shards' memory maps (or
    any 1-D integer arrays), or a contiguous slice of them.  ``len()``, slicing with a step of 1
    (views), ``max()``; :class:`BatchLoader` draws windows from it that never straddle two
    parts."""

    def __init__(self, parts: Sequence[Shard | np.ndarray], _spans: list[tuple[int, int]] | None = None) -> None:
        self.parts = list(parts)
        for q in self.parts:
            if isinstance(q, np.ndarray) and (q.ndim != 1 or q.dtype.kind not in "iu"):
                raise ValueError(f"TokenStream: parts must be 1-D integer arrays or shards, got {q.dtype} {q.shape}")
        self.spans = _spans if _spans is not None else [(0, _count(q)) for q in self.parts]
        self.lengths = np.array([b - a for a, b in self.spans], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.lengths.sum())

    def part(self, i: int) -> np.ndarray:
        """Part ``i``'s tokens (a view of its memory map)."""
        q = self.parts[i]
        a, b = self.spans[i]
        arr = q.tokens() if isinstance(q, Shard) else q
        return arr[a:b]

    def __getitem__(self, key: slice) -> TokenStream:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("TokenStream: only slices with step 1 (a contiguous range of the stream)")
        start, stop, _ = key.indices(len(self))
        parts, spans, pos = [], [], 0
        for q, (a, b) in zip(self.parts, self.spans):
            lo, hi = max(start, pos), min(stop, pos + (b - a))
            if lo < hi:
                parts.append(q)
                spans.append((a + lo - pos, a + hi - pos))
            pos += b - a
        return TokenStream(parts, spans)

    def max(self) -> int:
        return max(int(self.part(i).max()) for i in range(len(self.parts)) if self.lengths[i])

    def array(self) -> np.ndarray:
        """Every token in one array (this reads them all: for small streams and tests)."""
        if not self.parts:
            return np.zeros(0, np.int64)
        return np.concatenate([np.asarray(self.part(i)) for i in range(len(self.parts))])

    def sample(self, max_tokens: int = 1 << 24) -> np.ndarray:
        """All tokens when at most ``max_tokens``, else 64 evenly spaced slices adding up to about
        that many (for statistics such as :func:`unigram_entropy`)."""
        n = len(self)
        if n <= max_tokens:
            return self.array()
        w = max_tokens // 64
        return np.concatenate([self[s:s + w].array() for s in np.linspace(0, n - w, 64).astype(np.int64)])

    def __repr__(self) -> str:
        return f"TokenStream({len(self.parts)} parts, {len(self)} tokens)"


def _count(q: Shard | np.ndarray) -> int:
    return q.count if isinstance(q, Shard) else len(q)


def shard_tokenizer(data: ShardSet, spec: str, **kw: Any) -> Any:
    """The tokenizer ``--tokenizer spec`` names for token shards (which are not tokenized again):
    ``byte``, ``hf:PATH`` or a saved BPE; ``bpe:N`` (which trains on text) is refused."""
    if isinstance(spec, str) and spec.startswith("bpe:"):
        raise DataError(f"--tokenizer {spec} trains a BPE on text, and --data {data.spec} is already tokenized: "
                        "pass the tokenizer the shards were made with (hf:PATH), or byte")
    return get_tokenizer(spec, **kw)


def check_token_data(data: ShardSet, tokenizer: Any, block_size: int | None = None,
                     cache_dir_path: str | os.PathLike[str] | None = None, *, spec: str | None = None,
                     progress: bool = False) -> None:
    """Refuse token shards the run cannot use, in one :class:`DataError` line: a token id outside
    ``tokenizer``'s vocabulary (naming the shard and the byte; ``spec``: the --tokenizer the
    message names), or (with ``block_size``) a training or validation set without a window of
    ``block_size + 1`` tokens in one shard."""
    top, shard, at = data.max_token(cache_dir_path, progress=progress)
    V = tokenizer.vocab_size
    if top >= V:
        byte = shard.offset + at * shard.dtype.itemsize
        raise DataError(f"--data {str(shard.path)!r}: token id {top} at byte {byte} is outside the vocabulary of "
                        f"--tokenizer {spec or tokenizer.identity} ({V} ids, 0..{V - 1}); pass --tokenizer hf:PATH "
                        "with the tokenizer.json the shards were made with")
    if block_size is None:
        return
    for role, stream in zip(("training", "validation"), data.streams()):
        if not (stream.lengths > block_size).any():
            what = f"the validation set ({data.validation})" if role == "validation" else "the training set"
            raise DataError(f"--data {data.spec}: {what} holds no shard of more than --block-size {block_size} tokens "
                            f"(the longest has {int(stream.lengths.max()) if len(stream.lengths) else 0}); use a "
                            "smaller --block-size")


# ---------------------------------------------------------------------------- token cache

_TOK_MAGIC = b"HELIOSTK"
_TOK_VERSION = 1
_TOK_HEADER = struct.Struct("<8sIIQQ32s")  # magic, version, itemsize, count, vocab_size, sha256
assert _TOK_HEADER.size == 64


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _encoded(docs: Iterator[bytes], tokenizer: Any) -> Iterator[tuple[bytes, np.ndarray]]:
    """``(document, its ids)`` in order; a tokenizer with ``encode_batch`` (the Hugging Face one)
    gets the documents in groups of up to 256 documents or 4 MiB."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is None:
        for d in docs:
            yield d, tokenizer.encode(d)
        return
    pending: list[bytes] = []
    size = 0
    for d in docs:
        pending.append(d)
        size += len(d)
        if len(pending) >= 256 or size >= 1 << 22:
            yield from zip(pending, batch(pending))
            pending, size = [], 0
    if pending:
        yield from zip(pending, batch(pending))


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
        for doc, ids in _encoded(files, tokenizer):
            if parts:
                parts.append(sep)
            parts.append(np.asarray(ids).astype(dt))
            if bar is not None:
                bar.update(len(doc))
    finally:
        if bar is not None:
            bar.close()
    if not parts:
        raise corpus.no_text_error()
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
    """Random (B, T) windows of a 1-D token array (or a :class:`TokenStream` of shards) for
    next-token prediction.

    ``next_batch()`` returns ``(x, y)``, int64 arrays of shape
    ``(batch_size, block_size)`` with ``y[:, t] == x[:, t + 1]`` (``y`` is the
    same window shifted by one token).  Window starts are drawn uniformly from
    ``[0, len(tokens) - block_size - 1]`` by the loader's own PCG64 generator
    seeded with ``seed``; ``state_dict()`` captures that generator's exact
    state, so a loader restored with ``load_state_dict`` yields exactly the
    batches the uninterrupted one would have.  Over a stream of several parts
    (shards) the windows are those lying wholly inside one part, numbered part
    after part, and drawn the same way; only the tokens of the drawn windows are
    read.
    """

    _STATE_VERSION = 1

    def __init__(self, tokens: np.ndarray | TokenStream, batch_size: int, block_size: int, seed: int = 0) -> None:
        stream = tokens if isinstance(tokens, TokenStream) else None
        if stream is None and (not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype.kind not in "iu"):
            what = type(tokens).__name__
            if isinstance(tokens, np.ndarray):
                what += f" {tokens.dtype} of shape {tokens.shape}"
            raise ValueError(f"BatchLoader: tokens must be a 1-D integer numpy array or a TokenStream, got {what}")
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"BatchLoader: batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise ValueError(f"BatchLoader: block_size must be an int >= 1, got {block_size!r}")
        lengths = stream.lengths if stream is not None else np.array([len(tokens)], np.int64)
        if not (lengths > block_size).any():
            what = f"the split has {len(tokens)}" if len(lengths) == 1 else \
                f"the longest of the split's {len(lengths)} shards has {int(lengths.max())}"
            raise ValueError(
                f"BatchLoader: block_size {block_size} needs at least {block_size + 1} tokens, {what}; "
                "use a smaller --block-size, a smaller validation fraction or a larger corpus"
            )
        self.tokens = tokens
        self._stream = stream if stream is not None and len(stream.parts) > 1 else None
        # windows of each part, and the first window number of each
        self._part_windows = np.maximum(lengths - int(block_size), 0)
        self._part_first = np.cumsum(self._part_windows) - self._part_windows
        self.batch_size = int(batch_size)
        self.block_size = int(block_size)
        self.seed = int(seed)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        self.batches_served = 0
        self._arange = np.arange(self.block_size + 1, dtype=np.int64)

    @property
    def n_windows(self) -> int:
        """How many distinct window starts exist."""
        return int(self._part_windows.sum())

    def _gather(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._stream is None:  # one array (or one shard): window k starts at token k
            tokens = self.tokens.part(0) if isinstance(self.tokens, TokenStream) else self.tokens
            win = np.asarray(tokens[starts[:, None] + self._arange], dtype=np.int64)
        else:  # window k: the part it falls in, and its start there
            part = np.searchsorted(self._part_first + self._part_windows, starts, side="right")
            at = starts - self._part_first[part]
            n = self.block_size + 1
            win = np.empty((len(starts), n), np.int64)
            for r, (i, a) in enumerate(zip(part.tolist(), at.tolist())):
                win[r] = self._stream.part(i)[a:a + n]
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

    def _shape(self) -> dict[str, Any]:
        mine = {"batch_size": self.batch_size, "block_size": self.block_size, "n_tokens": len(self.tokens)}
        if self._stream is not None:  # several shards: their lengths too (one array keeps the old state)
            mine["shards"] = self._stream.lengths.tolist()
        return mine

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot of the position (store it in the checkpoint meta)."""
        return {
            "version": self._STATE_VERSION,
            "seed": self.seed,
            **self._shape(),
            "batches_served": self.batches_served,
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position from :meth:`state_dict`; ValueError if it was made for other data or shapes."""
        if state.get("version") != self._STATE_VERSION:
            raise ValueError(f"BatchLoader.load_state_dict: state version {state.get('version')!r}, "
                             f"expected {self._STATE_VERSION}")
        mine = self._shape()
        mine.setdefault("shards", None)
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


_ENTROPY_CHUNK = 1 << 20  # tokens counted at once: 8 MiB widened, not 128 MiB for a 16M-token sample


def unigram_entropy(tokens: np.ndarray | TokenStream, vocab_size: int) -> float:
    """Entropy in nats/token of the token frequencies in ``tokens``: ``-sum p log p`` (of a
    :class:`TokenStream`, over :meth:`TokenStream.sample`: every token up to 16M of them).

    This is the cross-entropy of the best model that ignores context (it
    predicts every position with the corpus's unigram distribution), so it is
    the baseline a language model's loss must get below to show it has learned
    anything from context; ``log(vocab_size)`` is the loss of a uniform guess,
    about where an untrained model starts.
    """
    t = (tokens.sample() if isinstance(tokens, TokenStream) else np.asarray(tokens)).reshape(-1)
    if t.size == 0:
        raise ValueError("unigram_entropy: no tokens")
    if t.dtype.kind not in "iu":
        raise ValueError(f"unigram_entropy: tokens must be integers, got {t.dtype}")
    if int(t.min()) < 0 or int(t.max()) >= vocab_size:
        raise ValueError(
            f"unigram_entropy: tokens must lie in [0, {vocab_size}), got [{int(t.min())}, {int(t.max())}]"
        )
    counts = np.zeros(vocab_size, np.int64)
    for i in range(0, t.size, _ENTROPY_CHUNK):  # bincount widens what it counts to int64: a chunk at a time
        counts += np.bincount(t[i:i + _ENTROPY_CHUNK], minlength=vocab_size)
    p = counts[counts > 0] / t.size
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------- one call for the trainer


@dataclass
class Dataset:
    """Everything the training script needs: corpus (or token shards), tokenizer and the split
    token streams (arrays for text, :class:`TokenStream` for shards)."""

    corpus: Corpus | ShardSet
    tokenizer: ByteTokenizer | BPETokenizer | HFTokenizer
    tokens: np.ndarray | TokenStream
    train: np.ndarray | TokenStream
    val: np.ndarray | TokenStream

    def summary(self, entropy: bool = True) -> dict[str, Any]:
        """Numbers worth logging at the start of a run; ``entropy=False`` leaves the unigram
        entropy out (None): it reads every training token, and only the rank that logs needs it."""
        return {
            "corpus": self.corpus.description,
            "files": len(self.corpus.files),
            "tokenizer": self.tokenizer.identity,
            "vocab_size": self.tokenizer.vocab_size,
            "tokens": len(self.tokens),
            "train_tokens": len(self.train),
            "val_tokens": len(self.val),
            "unigram_entropy_nats": unigram_entropy(self.train, self.tokenizer.vocab_size) if entropy else None,
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
    cache, and split it.  Token shards are not tokenized: their ids are checked against the
    tokenizer's vocabulary (:func:`check_token_data`) and split by the module doc's rule.

    ``cache_root`` replaces the cache folder: tokens go to ``cache_root/tokens``
    and trained tokenizers to ``cache_root/tokenizers``.
    """
    corpus = open_data(data)
    root = Path(cache_root) if cache_root is not None else None
    if isinstance(corpus, ShardSet):
        corpus.val_fraction = val_fraction
        tok = shard_tokenizer(corpus, tokenizer)
        check_token_data(corpus, tok, cache_dir_path=None if root is None else root / "tokens", spec=tokenizer,
                         progress=progress)
        train, val = corpus.streams()
        return Dataset(corpus, tok, TokenStream(corpus.train_shards + corpus.val_shards), train, val)
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
