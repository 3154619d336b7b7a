"""Crash-safe files: atomic writes and the single-file checkpoint container.

Every file Helios writes goes to a temporary name in the target's directory, is
flushed and fsynced, renamed over the target, and then the directory is fsynced
so that the rename itself is durable.  A crash at any point leaves either the
old file or the new one, never a torn mix.  On an exception inside the writer
the temporary file is removed and the target is untouched.

Checkpoint container (``save_checkpoint`` / ``load_checkpoint``), version 1::

    offset 0   8 bytes   magic  b"HELIOSCK"
           8   u32 LE    format version (1)
          12   u32 LE    reserved (0)
          16   u64 LE    header_len: bytes of the JSON index that follows
          24   u64 LE    data_len: bytes of the array region
          32   32 bytes  SHA-256 of everything after this 64-byte prefix
          64   header_len bytes of UTF-8 JSON: {"arrays": [...], "meta": {...}}
               zero padding to a multiple of 64
               array region: each array's raw little-endian C-order bytes at its
               recorded offset (relative to the region start), 64-byte aligned

Each index entry is ``{"name", "dtype" (numpy storage dtype, e.g. "<u2"),
"logical_dtype" (e.g. "bfloat16" or the storage dtype's name), "shape",
"offset", "nbytes"}``.  Dtypes numpy lacks (bfloat16, float8) are given as their
bit pattern in an unsigned integer array plus a logical dtype name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Literal, overload

import numpy as np

from helios.errors import CheckpointError, DTypeError

__all__ = [
    "atomic_write_bytes",
    "atomic_open",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint_meta",
    "fsync_dir",
    "LOGICAL_DTYPES",
    "cache_dir",
]

_MAGIC = b"HELIOSCK"
_VERSION = 1
_PREFIX = struct.Struct("<8sIIQQ32s")  # magic, version, reserved, header_len, data_len, sha256
assert _PREFIX.size == 64
_ALIGN = 64

# Dtypes numpy has no native type for, stored as their bit pattern.
LOGICAL_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype("<u2"),
    "float8_e4m3": np.dtype("u1"),
    "float8_e5m2": np.dtype("u1"),
}
_STORABLE_KINDS = "biufc"


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or removal in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows: directory handles are not openable this way
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_path(target: Path) -> Path:
    # Same directory as the target so that the rename never crosses filesystems.
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb", encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """Open ``path`` for writing so that it appears all at once or not at all.

    Yields a file object on a temporary file in the same directory.  When the
    ``with`` block ends normally the data is flushed, fsynced and renamed over
    ``path`` and the directory is fsynced.  When it raises, the temporary file
    is removed and ``path`` keeps its old content (or stays absent).
    ``mode`` is ``"wb"`` (binary) or ``"w"`` (text, ``encoding``).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open: mode must be 'wb' or 'w', got {mode!r}")
    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(
            f"atomic_open: directory {str(target.parent)!r} of {str(target)!r} does not exist; "
            "create it first"
        )
    tmp = _temp_path(target)
    # 0o666 & ~umask, like open(); O_EXCL so that we never write into someone else's file.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        f: IO[Any] = os.fdopen(fd, mode, encoding=encoding) if mode == "w" else os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        # Covers KeyboardInterrupt too: a half-written temp file must never survive.
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, directory fsync)."""
    with atomic_open(path, "wb") as f:
        f.write(data)


# ----------------------------------------------------------------------------- checkpoints


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def _json_default(obj: Any) -> Any:
    # numpy scalars are common in metadata (losses, step counters); store them as Python numbers.
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def _storage_array(name: str, arr: Any, logical: str | None) -> tuple[np.ndarray, str]:
    """Return the C-contiguous little-endian array to write and its logical dtype name."""
    if not isinstance(arr, np.ndarray):
        if isinstance(arr, np.generic):
            arr = np.asarray(arr)
        else:
            raise DTypeError(
                f"save_checkpoint: array {name!r} must be a numpy.ndarray, got {type(arr).__name__}; "
                "convert tensors with .numpy() first"
            )
    if arr.dtype.kind not in _STORABLE_KINDS:
        raise DTypeError(
            f"save_checkpoint: array {name!r} has dtype {arr.dtype} (kind {arr.dtype.kind!r}); "
            "only bool, integer, float and complex arrays can be stored"
        )
    if logical is not None:
        want = LOGICAL_DTYPES.get(logical)
        if want is None:
            raise DTypeError(
                f"save_checkpoint: unknown logical dtype {logical!r} for array {name!r}; "
                f"known: {sorted(LOGICAL_DTYPES)}"
            )
        if arr.dtype.kind != "u" or arr.dtype.itemsize != want.itemsize:
            raise DTypeError(
                f"save_checkpoint: array {name!r} declared {logical} must hold its bit pattern as "
                f"uint{want.itemsize * 8}, got {arr.dtype}; use arr.view(np.uint{want.itemsize * 8})"
            )
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d arrays into 1-d)
        arr = arr.copy(order="C")
    if arr.dtype.byteorder == ">":  # stored little-endian always
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr, logical if logical is not None else arr.dtype.name


def _bytes_view(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (works for 0-d and empty arrays)."""
    return arr.reshape(-1).view(np.uint8)


def save_checkpoint(
    path: str | os.PathLike[str],
    arrays: Mapping[str, np.ndarray],
    meta: Mapping[str, Any] | None = None,
    *,
    dtypes: Mapping[str, str] | None = None,
) -> None:
    """Write ``arrays`` and the JSON-serialisable ``meta`` to one checkpoint file, atomically.

    ``dtypes`` optionally names a logical dtype for some arrays whose bits are
    stored in an unsigned array (``{"w": "bfloat16"}`` with ``w`` a uint16
    array).  Non-contiguous and big-endian inputs are accepted; 0-d and empty
    arrays round-trip.  The payload is covered by a SHA-256 checked on load.
    """
    dtypes = dict(dtypes or {})
    unknown = set(dtypes) - set(arrays)
    if unknown:
        raise KeyError(f"save_checkpoint: dtypes names arrays that are not given: {sorted(unknown)}")
    entries: list[dict[str, Any]] = []
    stored: list[np.ndarray] = []
    offset = 0
    for name, arr in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"save_checkpoint: array names must be str, got {name!r}")
        a, logical = _storage_array(name, arr, dtypes.get(name))
        entries.append(
            {"name": name, "dtype": a.dtype.str, "logical_dtype": logical, "shape": list(a.shape),
             "offset": offset, "nbytes": int(a.nbytes)}
        )
        stored.append(a)
        offset += a.nbytes + _pad(a.nbytes)
    data_len = offset
    try:
        header = json.dumps({"arrays": entries, "meta": dict(meta or {})}, default=_json_default,
                            sort_keys=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint: meta for {str(path)!r} is not JSON-serialisable ({e}); "
                        "store arrays in `arrays` and plain numbers/strings/lists/dicts in `meta`") from e
    header_pad = b"\0" * _pad(len(header))

    h = hashlib.sha256()
    with atomic_open(path, "wb") as f:
        f.write(b"\0" * _PREFIX.size)  # placeholder, rewritten once the digest is known
        for chunk in (header, header_pad):
            h.update(chunk)
            f.write(chunk)
        for a in stored:
            u8 = _bytes_view(a)
            h.update(u8)
            f.write(u8.data)
            pad = b"\0" * _pad(a.nbytes)
            h.update(pad)
            f.write(pad)
        f.seek(0)
        f.write(_PREFIX.pack(_MAGIC, _VERSION, 0, len(header), data_len, h.digest()))


def _ckpt_error(path: Path, what: str, todo: str = "the file is damaged; restore it from a copy or "
                "resume from an earlier checkpoint") -> CheckpointError:
    return CheckpointError(f"checkpoint {str(path)!r}: {what}; {todo}")


def _read_exact_into(f: IO[bytes], buf: np.ndarray | bytearray, path: Path, what: str) -> None:
    mv = memoryview(buf).cast("B") if isinstance(buf, np.ndarray) else memoryview(buf)
    got = 0
    while got < len(mv):
        n = f.readinto(mv[got:])
        if not n:
            raise _ckpt_error(path, f"file ends early while reading {what} (truncated)")
        got += n


@overload
def load_checkpoint(
    path: str | os.PathLike[str], *, return_dtypes: Literal[False] = False
) -> tuple[dict[str, np.ndarray], dict[str, Any]]: ...
@overload
def load_checkpoint(
    path: str | os.PathLike[str], *, return_dtypes: Literal[True]
) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, str]]: ...


def _open_container(p: Path, missing_hint: str) -> IO[bytes]:
    """Open a checkpoint file read-only; a missing or unopenable one is a CheckpointError."""
    try:
        return open(p, "rb")
    except FileNotFoundError as e:
        raise _ckpt_error(p, "no such file", missing_hint) from e
    except OSError as e:
        raise _ckpt_error(p, f"cannot open ({e})", "check the permissions") from e


def _read_prefix(f: IO[bytes], p: Path) -> tuple[int, int, bytes]:
    """Check a container's 64-byte prefix and its file size; (header_len, data_len, SHA-256 digest)."""
    size = os.fstat(f.fileno()).st_size
    raw = f.read(_PREFIX.size)
    if len(raw) < 8 or raw[:8] != _MAGIC:
        raise _ckpt_error(p, f"not a Helios checkpoint (magic {raw[:8]!r}, expected {_MAGIC!r})",
                          "pass a file written by helios.fileio.save_checkpoint")
    if len(raw) < _PREFIX.size:
        raise _ckpt_error(p, f"file is {size} bytes, shorter than the {_PREFIX.size}-byte prefix (truncated)")
    _, version, reserved, header_len, data_len, digest = _PREFIX.unpack(raw)
    if version != _VERSION:
        raise _ckpt_error(p, f"format version {version}, this Helios reads version {_VERSION}",
                          "load it with the Helios version that wrote it")
    if reserved != 0:  # the only prefix field the digest and the size check do not cover
        raise _ckpt_error(p, f"reserved prefix field is {reserved:#x}, expected 0")
    expect = _PREFIX.size + header_len + _pad(header_len) + data_len
    if size != expect:
        kind = "truncated" if size < expect else "has trailing bytes"
        raise _ckpt_error(p, f"file is {size} bytes but its prefix describes {expect} ({kind})")
    return header_len, data_len, digest


def _parse_index(header: bytearray, header_len: int, p: Path) -> tuple[list, Any]:
    """(array entries, meta) of a container's JSON index."""
    try:
        index = json.loads(bytes(header[:header_len]).decode("utf-8"))
        return index["arrays"], index["meta"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise _ckpt_error(p, f"the JSON index cannot be parsed ({e})") from e


def read_checkpoint_meta(path: str | os.PathLike[str]) -> Any:
    """The ``meta`` of a checkpoint file, read from its index alone: the arrays are neither read
    nor hashed (so a damaged array region goes unnoticed; :func:`load_checkpoint` verifies).
    A missing, truncated, foreign or newer-version file raises CheckpointError."""
    p = Path(path)
    with _open_container(p, "check the path") as f:
        header_len, _, _ = _read_prefix(f, p)
        header = bytearray(header_len)
        _read_exact_into(f, header, p, "the index")
        return _parse_index(header, header_len, p)[1]


def load_checkpoint(path: str | os.PathLike[str], *, return_dtypes: bool = False) -> Any:
    """Read a checkpoint written by :func:`save_checkpoint`; returns ``(arrays, meta)``.

    With ``return_dtypes=True`` returns ``(arrays, meta, logical_dtypes)`` where
    ``logical_dtypes`` maps each array name to its logical dtype name (e.g.
    ``"bfloat16"`` for an array returned as uint16).  Each array is read
    straight into its own preallocated buffer (no second copy of the file in
    memory).  A missing, truncated, corrupt, foreign or newer-version file
    raises :class:`helios.errors.CheckpointError`; the file is opened read-only.
    """
    p = Path(path)
    with _open_container(p, "check the path, or start without --resume") as f:
        header_len, data_len, digest = _read_prefix(f, p)
        h = hashlib.sha256()
        header = bytearray(header_len + _pad(header_len))
        _read_exact_into(f, header, p, "the index")
        h.update(header)
        entries, meta = _parse_index(header, header_len, p)
        arrays: dict[str, np.ndarray] = {}
        logical: dict[str, str] = {}
        pos = 0
        try:
            for e in entries:
                dt = np.dtype(e["dtype"])
                shape = tuple(int(s) for s in e["shape"])
                nbytes = int(e["nbytes"])
                if e["offset"] != pos or nbytes != dt.itemsize * int(np.prod(shape, dtype=np.int64)) or \
                        pos + nbytes > data_len or dt.kind not in _STORABLE_KINDS:
                    raise _ckpt_error(p, f"index entry for {e['name']!r} is inconsistent")
                arr = np.empty(shape, dtype=dt)
                u8 = _bytes_view(arr)
                _read_exact_into(f, u8, p, f"array {e['name']!r}")
                h.update(u8)
                pad = bytearray(_pad(nbytes))
                _read_exact_into(f, pad, p, "padding")
                h.update(pad)
                pos += nbytes + len(pad)
                arrays[e["name"]] = arr
                logical[e["name"]] = e["logical_dtype"]
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError) as ex:
            # Only reachable when the index itself is damaged and the digest check below would fail too.
            raise _ckpt_error(p, f"the index is malformed ({type(ex).__name__}: {ex})") from ex
        if pos != data_len:
            raise _ckpt_error(p, f"index covers {pos} bytes of a {data_len}-byte array region")
        if h.digest() != digest:
            raise _ckpt_error(p, f"SHA-256 mismatch (stored {digest.hex()[:16]}..., computed "
                                 f"{h.hexdigest()[:16]}...): the content is corrupt")
    if return_dtypes:
        return arrays, meta, logical
    return arrays, meta


def cache_dir(kind: str, override: str | os.PathLike[str] | None = None) -> Path:
    """The directory for cached ``kind`` files (``"tokens"``, ``"tokenizers"``), created if needed.

    ``override`` wins; else ``$HELIOS_CACHE_DIR/<kind>``; else
    ``$XDG_CACHE_HOME/helios/<kind>``; else ``~/.cache/helios/<kind>``.
    """
    if override is not None:
        d = Path(override)
    elif os.environ.get("HELIOS_CACHE_DIR"):
        d = Path(os.environ["HELIOS_CACHE_DIR"]) / kind
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = Path(base) / "helios" / kind
    d.mkdir(parents=True, exist_ok=True)
    return d
