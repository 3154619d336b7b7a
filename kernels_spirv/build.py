"""Compile every GLSL kernel variant to SPIR-V with glslc.

Run at build time by setup.py (``compile_all``) and at run time by the registry
for a variant whose .spv is missing or older than its source.  This file must
not import helios: setup.py loads it by path before the package exists.

A kernel is ``glsl/<name>.comp``.  Its variants are listed in
``glsl/<name>.variants``: one line per variant, ``<variant> <-DKEY=VALUE ...>``
(``#`` starts a comment).  A kernel without a variants file has one variant,
``default``.  The output is ``<out>/<name>.<variant>.spv``.

``glsl/ew_ops.gen.glsl`` (the elementwise op switch) is generated from the op table
``ew_ops.py`` before anything is compiled (:func:`generate_sources`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

_HERE = os.path.dirname(os.path.abspath(__file__))
GLSL_DIR = os.path.join(_HERE, "glsl")
TARGET_ENV = "--target-env=vulkan1.2"
EW_OPS = os.path.join(_HERE, "ew_ops.py")  # the elementwise op table, source of glsl/ew_ops.gen.glsl

_ew_ops = None


def ew_ops():
    """The op table module (kernels_spirv/ew_ops.py), loaded by path: the package may not exist yet."""
    global _ew_ops
    if _ew_ops is None:
        spec = importlib.util.spec_from_file_location("helios_ew_ops_build", EW_OPS)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        _ew_ops = mod
    return _ew_ops


def generate_sources() -> bool:
    """Rewrite the generated GLSL (glsl/ew_ops.gen.glsl) where the op table changed; True if it did.

    An installed package without the table (or a read-only one whose file is current) is left alone."""
    if not os.path.exists(EW_OPS):
        return False
    return ew_ops().write()


def find_glslc() -> str:
    """Path of glslc, or an error that says which package provides it."""
    path = shutil.which(os.environ.get("GLSLC", "glslc"))
    if path is None:
        raise RuntimeError("glslc not found: install it (Debian/Ubuntu: apt-get install glslc) or set GLSLC=/path/to/glslc")
    return path


def kernel_variants(name: str) -> dict[str, list[str]]:
    """Variant name -> list of -D defines, for kernel ``name``."""
    vfile = os.path.join(GLSL_DIR, name + ".variants")
    if not os.path.exists(vfile):
        return {"default": []}
    out: dict[str, list[str]] = {}
    with open(vfile) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                variant, *defines = line.split()
                out[variant] = defines
    return out


def kernel_names() -> list[str]:
    """Every kernel with a .comp source."""
    return sorted(f[:-5] for f in os.listdir(GLSL_DIR) if f.endswith(".comp"))


def source_mtime(name: str) -> float:
    """Newest mtime among the kernel's source, its variants file and the shared includes."""
    paths = [os.path.join(GLSL_DIR, name + ".comp"), os.path.join(GLSL_DIR, name + ".variants")]
    paths += [os.path.join(GLSL_DIR, f) for f in os.listdir(GLSL_DIR) if f.endswith(".glsl")]
    paths.append(EW_OPS)  # the table the generated include comes from
    return max(os.path.getmtime(p) for p in paths if os.path.exists(p))


def compile_variant(name: str, variant: str, defines: list[str], out_path: str, glslc: str | None = None) -> str:
    """Compile one variant to ``out_path`` (temp name, then rename); return the path."""
    glslc = glslc or find_glslc()
    generate_sources()
    src = os.path.join(GLSL_DIR, name + ".comp")
    tmp = f"{out_path}.{os.getpid()}.tmp"
    cmd = [glslc, TARGET_ENV, "-O", "-I", GLSL_DIR, *defines, src, "-o", tmp]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"glslc failed for kernel {name} variant {variant}:\n{' '.join(cmd)}\n{res.stderr}")
    os.replace(tmp, out_path)
    return out_path


def compile_all(out_dir: str, jobs: int | None = None) -> int:
    """Compile every stale variant of every kernel into ``out_dir``; return how many were built."""
    os.makedirs(out_dir, exist_ok=True)
    generate_sources()
    names = kernel_names()
    if not names:
        return 0
    glslc = find_glslc()
    todo = []
    for name in names:
        mtime = source_mtime(name)
        for variant, defines in kernel_variants(name).items():
            out = os.path.join(out_dir, f"{name}.{variant}.spv")
            if not os.path.exists(out) or os.path.getmtime(out) < mtime:
                todo.append((name, variant, defines, out))
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        list(pool.map(lambda t: compile_variant(*t, glslc=glslc), todo))
    return len(todo)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "spv")
    n = compile_all(out)
    print(f"compiled {n} kernel variant(s) into {out}")
