"""ptxas / cuobjdump / nvdisasm: finding them, the cubin cache, and reading their output.

Cubins are cached under ``$XDG_CACHE_HOME/helios/cubin`` (else ``~/.cache/helios``),
keyed by the SHA-256 of (PTX text, ptxas version, arch, flags); each entry is the
cubin plus the ptxas ``-v`` log, both written to a temporary name, fsynced and
renamed, so a crash never leaves a torn cubin behind.  A cached cubin's disassembly is
cached beside it (``sass``), keyed by the disassembler's path, size and mtime: the gate
reads every kernel's SASS, and ``cuobjdump`` takes about half a second a kernel.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from helios.errors import DeviceError


class ToolMissing(DeviceError):
    """A CUDA command-line tool (ptxas, cuobjdump, nvdisasm) is not installed."""


def _wheel_bins() -> list[str]:
    """``bin`` folders of the NVIDIA PyPI wheels (nvidia-cuda-nvcc, -nvdisasm, -cuobjdump)."""
    out = []
    for root in sys.path:
        out += glob.glob(os.path.join(root, "nvidia", "*", "bin"))
        out += glob.glob(os.path.join(root, "nvidia", "*", "*", "bin"))
    return out


@functools.cache
def find_tool(name: str) -> str | None:
    """Path of ``name``: ``$HELIOS_<NAME>``, then ``PATH``, then the NVIDIA wheels' bin folders."""
    env = os.environ.get(f"HELIOS_{name.upper()}")
    if env:
        return env
    hit = shutil.which(name)
    if hit:
        return hit
    for d in _wheel_bins():
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return None


def require_tool(name: str) -> str:
    """Like :func:`find_tool` but raises :class:`ToolMissing` saying how to get it."""
    p = find_tool(name)
    if p is None:
        hint = {
            "ptxas": "install the CUDA toolkit or `pip install nvidia-cuda-nvcc`",
            "cuobjdump": "`pip install nvidia-cuda-cuobjdump`",
            "nvdisasm": "`pip install nvidia-cuda-nvdisasm`",
        }.get(name, "install the CUDA toolkit")
        raise ToolMissing(f"{name} not found on PATH or in the NVIDIA wheels; {hint} (or set HELIOS_{name.upper()})")
    return p


@functools.cache
def ptxas_version() -> str:
    """``ptxas --version``'s release line, e.g. ``V13.0.88`` (part of the cache key)."""
    out = subprocess.run([require_tool("ptxas"), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(0) if m else out.strip().splitlines()[-1]


def cache_dir() -> Path:
    """The user cache folder for Helios (``$XDG_CACHE_HOME/helios`` or ``~/.cache/helios``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "helios"


def cubin_dir() -> Path:
    """Where compiled cubins (and their ptxas logs and SASS listings) are cached, named by content."""
    return cache_dir() / "cubin"


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass
class PtxasInfo:
    """What ``ptxas -v`` said about one kernel."""

    registers: int = -1
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    notes: list[str] = field(default_factory=list)  # C-codes of info/warning diagnostics, e.g. "C7508"
    log: str = ""


def parse_ptxas_log(log: str) -> PtxasInfo:
    """Extract registers, spills, stack and the ``(Cxxxx)`` diagnostic codes from a ``-v`` log."""
    info = PtxasInfo(log=log)
    m = re.search(r"Used (\d+) registers", log)
    if m:
        info.registers = int(m.group(1))
    for m in re.finditer(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log):
        info.stack_frame += int(m.group(1))
        info.spill_stores += int(m.group(2))
        info.spill_loads += int(m.group(3))
    info.notes = sorted(set(re.findall(r"\((C\d{4})\)", log)))
    return info


@dataclass
class Compiled:
    """A cubin on disk with its ptxas report."""

    cubin: Path
    arch: str
    info: PtxasInfo
    cached: bool


class PtxasError(DeviceError):
    """ptxas rejected a PTX module; the message holds its log."""


def compile_ptx(ptx: str, arch: str, extra: tuple[str, ...] = ()) -> Compiled:
    """Assemble ``ptx`` for ``arch`` (``sm_80``, ``sm_90a``) with ``-v``; cached by content."""
    ptxas = require_tool("ptxas")
    flags = ("-v", "-O3", *extra)
    key = hashlib.sha256("\0".join([ptx, ptxas_version(), arch, *flags]).encode()).hexdigest()[:32]
    d = cubin_dir()
    cubin, logf = d / f"{key}.cubin", d / f"{key}.json"
    if cubin.exists() and logf.exists():
        try:
            log = json.loads(logf.read_text())["log"]
            return Compiled(cubin, arch, parse_ptxas_log(log), cached=True)
        except (ValueError, KeyError):
            pass  # a damaged log entry: rebuild it
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        r = subprocess.run(
            [ptxas, f"-arch={arch}", *flags, str(src), "-o", str(out)], capture_output=True, text=True, check=False
        )
        log = r.stdout + r.stderr
        if r.returncode != 0:
            raise PtxasError(f"ptxas -arch={arch} rejected the generated PTX:\n{log}")
        data = out.read_bytes()
    atomic_write(cubin, data)
    atomic_write(logf, json.dumps({"log": log, "arch": arch, "ptxas": ptxas_version()}).encode())
    return Compiled(cubin, arch, parse_ptxas_log(log), cached=False)


def sass(cubin: Path) -> str:
    """Disassemble a cubin: ``cuobjdump -sass`` where present, else ``nvdisasm``; a listing made
    before by the same tool for a cubin of the cache is read back (see the module doc)."""
    tool = find_tool("cuobjdump")
    if tool:
        cmd = [tool, "-sass", str(cubin)]
    else:
        cmd = [require_tool("nvdisasm"), str(cubin)]
    cubin = Path(cubin)
    cacheable = cubin.parent == cubin_dir()  # named by content: the listing cannot go stale
    if cacheable:
        st = os.stat(cmd[0])
        tool_key = hashlib.sha256(f"{cmd[0]}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
        listing = cubin.with_name(f"{cubin.stem}.{tool_key}.sass")
        if listing.exists():
            return listing.read_text()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise DeviceError(f"{cmd[0]} failed on {cubin}: {r.stderr.strip()}")
    if cacheable:
        atomic_write(listing, r.stdout.encode())
    return r.stdout


def opcode_counts(sass_text: str) -> dict[str, int]:
    """Count SASS opcodes (the mnemonic before the first '.' or space) in a listing."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass_text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts
