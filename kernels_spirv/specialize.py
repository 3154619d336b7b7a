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
of the module and the values, so later processes read it back; the driver then gets a
module a fifth of the size and builds it about 5x faster.

Where spirv-opt is missing, or ``HELIOS_SPECIALIZE=0``, pipelines are specialized by the
driver as before (same results, slower start-up).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Sequence

ENABLED = os.environ.get("HELIOS_SPECIALIZE", "1") != "0"

# Smaller modules go to the driver as they are.  Measured on lavapipe (one pipeline, cold
# cache): spirv-opt costs about twice what the driver spends on a module, and the driver then
# builds the frozen one 2-20x faster; below ~64 KB (copies, reductions, softmax, binary ops)
# the driver's whole cost is 1-15 ms, so a cold spirv-opt run would not pay for itself.
MIN_BYTES = 64 * 1024

# Only specialization and dead-code removal: no pass that changes arithmetic.
PASSES = ("--freeze-spec-const", "--fold-spec-const-op-composite", "--eliminate-dead-branches",
          "--merge-blocks", "--eliminate-dead-code-aggressive", "--eliminate-dead-functions")

_OP_DECORATE, _DECORATION_SPEC_ID = 71, 1
_OP_TYPE_BOOL, _OP_TYPE_INT, _OP_TYPE_FLOAT = 20, 21, 22
_OP_SPEC_TRUE, _OP_SPEC_FALSE, _OP_SPEC = 48, 49, 50
_MAGIC = 0x07230203

_memo: dict[bytes, bytes | None] = {}


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


def specialize(code: bytes, spec: Sequence[int]) -> bytes | None:
    """``code`` with specialization constant i set to ``spec[i]``, frozen, and the code it makes
    dead removed; None where the driver should specialize instead (switched off, no spirv-opt,
    nothing to specialize, a module under MIN_BYTES, a constant of a kind not handled, or
    spirv-opt failing)."""
    if not ENABLED or not spec or len(code) < MIN_BYTES:
        return None
    key = hashlib.sha256(code + repr(tuple(int(s) for s in spec)).encode()).hexdigest()
    memo_key = key.encode()
    if memo_key in _memo:
        return _memo[memo_key]
    _memo[memo_key] = out = _specialize_uncached(code, spec, key)
    return out


def _specialize_uncached(code: bytes, spec: Sequence[int], key: str) -> bytes | None:
    path = _cache_path(key)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        pass
    exe = spirv_opt()
    if exe is None:
        return None
    kinds = spec_constant_kinds(code)
    values = []
    for sid, v in enumerate(spec):
        if sid in kinds:
            text = _value(kinds[sid], v)
            if text is None:
                return None
            values.append(f"{sid}:{text}")
    if not values:
        return None
    return _run_spirv_opt(exe, code, " ".join(values), path)


def _run_spirv_opt(exe: str, code: bytes, values: str, path: str) -> bytes | None:
    """spirv-opt over ``code``; the result written to ``path`` (temp name, fsync, rename) and returned."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in.spv"), os.path.join(d, "out.spv")
        with open(src, "wb") as f:
            f.write(code)
        res = subprocess.run([exe, "--set-spec-const-default-value", values, *PASSES, src, "-o", dst],
                             capture_output=True, timeout=120)
        if res.returncode != 0 or not os.path.exists(dst):
            return None
        with open(dst, "rb") as f:
            out = f.read()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(out)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # ranks building the same pipeline at once each write whole files
    return out
