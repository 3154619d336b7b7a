"""Specialization constants frozen into a kernel's SPIR-V before the driver sees it.

A kernel is one SPIR-V module for every mode its specialization constants select (matmul's
operand layouts, epilogues, bias, ...), so most of a module is code a given pipeline never
runs.  A driver that specializes it itself must still parse and optimise all of it, every
time a process builds the pipeline: Mesa's lavapipe (22.x) caches the machine code it makes
but not that work, so a process spent about 1.4 s making one fused-epilogue matmul pipeline
on this project's 2-core machine, and most of a short training run's start-up.

``specialize`` runs spirv-opt (SPIRV-Tools) once per (module, constants): it sets the
constants to the pipeline's values, freezes them into ordinary constants, folds the
expressions made of them, and removes the branches and code they make dead.  Nothing
else is transformed (no arithmetic is reordered or contracted), so the kernel computes what
the driver-specialized one computes, bit for bit.  The result is cached on disk by a hash
of the module and the values; the driver then gets a module a third to a fifth of the size
and builds it 2-10x faster (matmul_epi.f32_sg16x8: 1.4 s -> 0.12-0.28 s, loaded machine).

spirv-opt itself costs about twice what the driver spends on the whole module, so it runs
in the background (``HELIOS_SPECIALIZE=1``, the default): a process that misses the cache
has the driver specialize as before and, from the second process that asks for the same
pipeline on, leaves the frozen module for the processes after it (the ranks of the next run,
the next run); a pipeline built by one process only is never frozen, so a tool sweeping many
shapes in one process starts no job.  It never waits; the jobs run at the lowest priority.
``HELIOS_SPECIALIZE=sync`` waits for spirv-opt instead; ``0`` (or no spirv-opt installed)
leaves it to the driver.

``unrolled`` freezes a kernel the same way for the PTX translation (helios.cuda_ptx.spirv_ptx),
in the process that asks, and also unrolls its [[unroll]] loops (UNROLL_PASSES).

Run as a script (``python specialize.py IN OUT SPEC...``) it is the background job.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

MODE = os.environ.get("HELIOS_SPECIALIZE", "1")  # "1" background, "sync", "0" off
ENABLED = MODE != "0"
MAX_BACKGROUND = 8  # spirv-opt jobs a process runs at once (at the lowest priority); a miss beyond that waits for a later process

# Smaller modules go to the driver as they are.  Measured on lavapipe (one pipeline each,
# nano training's constants): frozen, a module of 10-40 KB builds 1.8-9x faster (ew_binary
# 6.6 -> 0.7 ms, layer_norm 7.0 -> 2.8 ms, softmax 4.9 -> 2.7 ms), and every rank of every
# later run pays the driver's cost again while spirv-opt runs once per machine, in the
# background, from the second process on (_first_sight).  Below ~10 KB (copies, embeddings,
# the random generator, AdamW) freezing gains nothing measurable (0.5-2.2 ms either way).
MIN_BYTES = 10 * 1024

# Only specialization and dead-code removal: no pass that changes arithmetic.
PASSES = ("--freeze-spec-const", "--fold-spec-const-op-composite", "--eliminate-dead-branches",
          "--merge-blocks", "--eliminate-dead-code-aggressive", "--eliminate-dead-functions")

# For the PTX translation (helios.cuda_ptx.spirv_ptx), which runs a loop as a loop and a
# function-scope array as per-thread memory: after the freeze, loops marked [[unroll]] are unrolled
# (nested ones too: a second --loop-unroll gave the same bytes on the 30 matmul and matmul_epi
# modules tried), the now constant indices propagated (--ccp), and the arrays they index split
# into SSA values.  Still no pass that reorders, contracts or re-rounds arithmetic.
UNROLL_PASSES = PASSES + ("--loop-unroll", "--ccp", "--scalar-replacement=0", "--ssa-rewrite",
                          "--eliminate-dead-code-aggressive", "--merge-blocks")

_OP_DECORATE, _DECORATION_SPEC_ID = 71, 1
_OP_LOOP_MERGE, _LOOP_CONTROL_UNROLL = 246, 0x1
_OP_TYPE_BOOL, _OP_TYPE_INT, _OP_TYPE_FLOAT = 20, 21, 22
_OP_SPEC_TRUE, _OP_SPEC_FALSE, _OP_SPEC = 48, 49, 50
_MAGIC = 0x07230203

_memo: dict[str, bytes | None] = {}  # this process's answers, by key


def spirv_opt() -> str | None:
    """Path of spirv-opt (``SPIRV_OPT`` overrides), or None where it is not installed."""
    return shutil.which(os.environ.get("SPIRV_OPT", "spirv-opt"))


def spec_constant_kinds(code: bytes) -> dict[int, str]:
    """{SpecId: "bool" | "int" | "uint" | "float"} of a SPIR-V module's specialization constants."""
    n = len(code) // 4
    words = struct.unpack(f"<{n}I", code[:4 * n])
    if n < 5 or words[0] != _MAGIC:
        raise ValueError("not a little-endian SPIR-V module")
    spec_id_of: dict[int, int] = {}   # result id -> SpecId
    kind_of_type: dict[int, str] = {}  # type id -> kind
    type_of_const: dict[int, int] = {}  # spec constant result id -> type id
    i = 5
    while i < n:
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if count == 0:
            raise ValueError("malformed SPIR-V instruction")
        if op == _OP_DECORATE and words[i + 2] == _DECORATION_SPEC_ID:
            spec_id_of[words[i + 1]] = words[i + 3]
        elif op == _OP_TYPE_BOOL:
            kind_of_type[words[i + 1]] = "bool"
        elif op == _OP_TYPE_INT:
            kind_of_type[words[i + 1]] = "int" if words[i + 3] else "uint"
        elif op == _OP_TYPE_FLOAT:
            kind_of_type[words[i + 1]] = "float"
        elif op in (_OP_SPEC_TRUE, _OP_SPEC_FALSE, _OP_SPEC):
            type_of_const[words[i + 2]] = words[i + 1]
        i += count
    return {sid: kind_of_type.get(type_of_const.get(rid), "other") for rid, sid in spec_id_of.items()}


def _value(kind: str, v: int) -> str | None:
    """spirv-opt's spelling of the value ``v`` the driver would get for a constant of ``kind``."""
    v = int(v)
    if kind == "bool":
        return "true" if v else "false"
    if kind == "int":
        return str(v)
    if kind == "uint":
        return str(v & 0xFFFFFFFF)
    return None  # float or wider constants: leave them to the driver


def _cache_path(key: str) -> str:
    from helios.kernels_spirv.registry import cache_dir

    return os.path.join(cache_dir(), "spv", "specialized", key + ".spv")


def _key(code: bytes, spec: Sequence[int], passes: Sequence[str]) -> str:
    """The cache key of ``code`` frozen at ``spec`` through ``passes`` (a changed pass list is
    another module, never the one cached before it)."""
    return hashlib.sha256(code + repr((tuple(int(s) for s in spec), tuple(passes))).encode()).hexdigest()


_UNKNOWN = object()  # _known's "neither this process nor the disk cache has an answer"


def _known(key: str):
    """This process's earlier answer for ``key`` (a module, or None: the driver's), else the module
    cached on disk (remembered from now on), else _UNKNOWN."""
    if key in _memo:
        return _memo[key]
    try:
        with open(_cache_path(key), "rb") as f:
            _memo[key] = out = f.read()
        return out
    except OSError:
        return _UNKNOWN


def specialize(code: bytes, spec: Sequence[int], wait: bool | None = None) -> bytes | None:
    """``code`` with specialization constant i set to ``spec[i]``, frozen, and the code it makes
    dead removed, from the disk cache; None where the driver should specialize this time
    (switched off, nothing to specialize, a module under MIN_BYTES, or not cached yet: then
    spirv-opt runs in the background for later processes, unless ``wait`` (default: the
    ``sync`` mode) asks to wait for it).  None too where spirv-opt is missing or fails."""
    if not ENABLED or not spec or len(code) < MIN_BYTES:
        return None
    key = _key(code, spec, PASSES)
    out = _known(key)
    if out is not _UNKNOWN:
        return out
    path = _cache_path(key)
    if wait is None:
        wait = MODE == "sync"
    if wait:
        _memo[key] = out = (_freeze(code, [int(v) for v in spec], path) if spirv_opt() else None)
        return out
    if not _first_sight(key):
        _start_background(code, spec, path)
    _memo[key] = None  # the driver's pipeline is built once per process anyway
    return None


def has_unroll_loops(code: bytes) -> bool:
    """Whether a SPIR-V module has a loop marked [[unroll]] (an OpLoopMerge with the Unroll control)."""
    n = len(code) // 4
    words = struct.unpack(f"<{n}I", code[:4 * n])
    i = 5
    while i < n:
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if op == _OP_LOOP_MERGE and words[i + 3] & _LOOP_CONTROL_UNROLL:
            return True
        i += max(count, 1)
    return False


def unrolled(code: bytes, spec: Sequence[int]) -> bytes | None:
    """``code`` with its specialization constants set to ``spec`` and frozen, and its [[unroll]]
    loops unrolled, their arrays split into values (UNROLL_PASSES), from the disk cache or made
    now; None where the module has no such loop, or spirv-opt is missing or fails."""
    if not has_unroll_loops(code):
        return None
    key = _key(code, spec, UNROLL_PASSES)
    out = _known(key)
    if out is _UNKNOWN:
        _memo[key] = out = _freeze(code, [int(v) for v in spec], _cache_path(key), UNROLL_PASSES) if spirv_opt() else None
    return out


def _first_sight(key: str) -> bool:
    """True the first time any process misses ``key`` (it leaves a mark for the next one).

    Only a pipeline that a second process asks for is frozen: a (module, constants) pair made
    by one process only (a sweep of shapes in one process, one test's odd sizes) is never
    built again, and spirv-opt on it would cost twice what the driver spent.  The test suite
    on a fresh cache started 434 background jobs before this rule and 222 with it (its CPU
    time within the runs' noise: 1921 s and 1948 s user+system)."""
    from helios.kernels_spirv.registry import cache_dir

    mark = os.path.join(cache_dir(), "spv", "seen", key)
    try:
        os.makedirs(os.path.dirname(mark), exist_ok=True)
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except OSError:  # marked already (or no mark can be left): freeze it now
        return False
    return True


_background: list[subprocess.Popen] = []


def _start_background(code: bytes, spec: Sequence[int], path: str) -> None:
    """spirv-opt on ``code`` in a process of its own that writes ``path``; nothing if this process
    already runs MAX_BACKGROUND of them or another process is making the same file."""
    _background[:] = [p for p in _background if p.poll() is None]
    if len(_background) >= MAX_BACKGROUND or spirv_opt() is None:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    claim = path + ".in"
    try:  # the input file is the claim: one maker per file
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if time.time() - os.path.getmtime(claim) > 300:  # left by a maker that died
            os.unlink(claim)
        return
    with os.fdopen(fd, "wb") as f:
        f.write(code)
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []  # idle cores only (no preexec_fn: threads)
    _background.append(subprocess.Popen([*nice, sys.executable, os.path.abspath(__file__), claim, path,
                                         *(str(int(v)) for v in spec)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True))


def _freeze(code: bytes, spec: list[int], path: str, passes: Sequence[str] = PASSES) -> bytes | None:
    """spirv-opt ``passes`` over ``code`` with ``spec`` frozen in; the result written to ``path``
    (temp name, fsync, rename) and returned; None where a constant's kind is not handled or
    spirv-opt fails."""
    kinds = spec_constant_kinds(code)
    values = []
    for sid, v in enumerate(spec):
        if sid in kinds:
            text = _value(kinds[sid], v)
            if text is None:
                return None
            values.append(f"{sid}:{text}")
    if not values and passes == PASSES:  # nothing to freeze: the driver gets the module as it is
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in.spv"), os.path.join(d, "out.spv")
        with open(src, "wb") as f:
            f.write(code)
        setting = ["--set-spec-const-default-value", " ".join(values)] if values else []
        res = subprocess.run([spirv_opt(), *setting, *passes, src, "-o", dst], capture_output=True, timeout=300)
        if res.returncode != 0 or not os.path.exists(dst):
            return None
        with open(dst, "rb") as f:
            out = f.read()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(out)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # ranks making the same file at once each write whole files
    return out


def _background_main(argv: list[str]) -> int:
    """The background job: IN (the claimed input) OUT SPEC...; removes IN when done."""
    claim, path, spec = argv[0], argv[1], [int(v) for v in argv[2:]]
    try:
        with open(claim, "rb") as f:
            code = f.read()
        return 0 if _freeze(code, spec, path) is not None else 1
    finally:
        os.unlink(claim)


if __name__ == "__main__":
    sys.exit(_background_main(sys.argv[1:]))
