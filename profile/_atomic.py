"""Crash-safe file writes: temp name in the same folder, fsync, rename, fsync the folder.

A reader (or a crash at any moment) sees either the old file or the whole new
one, never a torn file.
"""

from __future__ import annotations

import os
import tempfile


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> str:
    """Write ``data`` to ``path`` atomically and durably; returns the absolute path."""
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    # The temp file lives in the target folder so the rename never crosses a filesystem.
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    # fsync the folder so the rename itself survives a power loss.
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return path
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> str:
    """Write UTF-8 ``text`` to ``path`` atomically; returns the absolute path."""
    return atomic_write_bytes(path, text.encode("utf-8"))
