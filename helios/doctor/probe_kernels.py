"""The kernels section: every SPIR-V variant built and current, glslc, the pipeline cache, Mesa's shader cache."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .report import Section
from .util import dir_usage, human_bytes

SPIRV_MAGIC = b"\x03\x02\x23\x07"  # 0x07230203, little-endian as glslc writes it


def kernel_status(registry, builder) -> dict:
    """{"current": [...], "rebuilt": [...], "stale": [...], "missing": [...], "corrupt": [...]} of "kernel.variant" names.

    Mirrors :func:`helios.kernels_spirv.registry.spirv`: a packaged .spv older than its GLSL
    (or the shared includes) is stale, and a newer copy in the user cache stands in for it."""
    out: dict[str, list[str]] = {"current": [], "rebuilt": [], "stale": [], "missing": [], "corrupt": []}
    cache = os.path.join(registry.cache_dir(), "spv")
    for name in builder.kernel_names():
        src = builder.source_mtime(name)
        for variant in builder.kernel_variants(name):
            fname = f"{name}.{variant}.spv"
            key = f"{name}.{variant}"
            packaged, cached = os.path.join(registry.PACKAGED_SPV, fname), os.path.join(cache, fname)
            if os.path.exists(packaged) and os.path.getmtime(packaged) >= src:
                path, bucket = packaged, "current"
            elif os.path.exists(cached) and os.path.getmtime(cached) >= src:
                path, bucket = cached, "rebuilt"
            else:
                out["stale" if os.path.exists(packaged) else "missing"].append(key)
                continue
            with open(path, "rb") as f:
                head = f.read(4)
            out[bucket if head == SPIRV_MAGIC else "corrupt"].append(key)
    return out


# A VkPipelineCache blob's header (its length, version, vendor, device and 16-byte UUID): a blob of
# this size holds no pipeline.  Mesa 22.3's lavapipe saves nothing more; llvmpipe keeps its compiled
# code in Mesa's shader cache instead.
VK_CACHE_HEADER_BYTES = 32


def pipeline_cache(pipes: str) -> dict:
    """What the pipeline cache folder holds: the saved VkPipelineCache blobs (one per device, keyed by
    pipelineCacheUUID) and their bytes, how many hold the header alone, and the temporary files of
    saves that never finished (a process killed while writing one)."""
    names = sorted(os.listdir(pipes)) if os.path.isdir(pipes) else []
    blobs = [n for n in names if n.startswith("pipeline_cache_") and n.endswith(".bin")]
    sizes = [os.path.getsize(os.path.join(pipes, n)) for n in blobs]
    return {"path": pipes, "files": len(blobs), "bytes": sum(sizes),
            "header_only": sum(size <= VK_CACHE_HEADER_BYTES for size in sizes),
            "leftovers": [n for n in names if ".bin.tmp." in n]}


def pipeline_cache_text(pc: dict) -> str:
    """The doctor's line for :func:`pipeline_cache`'s findings."""
    text = f"{pc['path']}: {pc['files']} blob(s), {human_bytes(pc['bytes'])}"
    if pc["files"] and pc["header_only"] == pc["files"]:
        text += (" holding no pipelines: the driver saves only the blob's header (lavapipe does; its compiled "
                 "kernels are in Mesa's shader cache)")
    else:
        text += " (VkPipelineCache per device, keyed by pipelineCacheUUID)"
    if pc["leftovers"]:
        text += (f"; {len(pc['leftovers'])} temporary file(s) of a save that never finished ({pc['leftovers'][0]}: "
                 "a process stopped while writing it), safe to delete")
    return text


def mesa_shader_cache(env: Mapping[str, str]) -> tuple[str | None, str]:
    """(folder, note) of Mesa's on-disk shader cache as Mesa resolves it (None when disabled)."""
    if env.get("MESA_SHADER_CACHE_DISABLE", "").lower() in ("1", "true", "yes"):
        return None, "disabled by MESA_SHADER_CACHE_DISABLE"
    if env.get("MESA_SHADER_CACHE_DIR"):
        return env["MESA_SHADER_CACHE_DIR"], "MESA_SHADER_CACHE_DIR"
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    # Mesa 23.1+ defaults to a single-file database next to the older multi-file layout.
    for sub in ("mesa_shader_cache_db", "mesa_shader_cache"):
        if os.path.isdir(os.path.join(base, sub)):
            return os.path.join(base, sub), "default location"
    return os.path.join(base, "mesa_shader_cache"), "default location (not created yet)"


def _coopmat_kernels(builder, st: dict, s: Section) -> None:
    """Take the cooperative-matrix kernels' unbuilt variants out of ``st`` (only GPUs listing cooperative
    matrices run them, and the registry builds them on first use) and say whether they can be built."""
    needs = getattr(builder, "needs_coopmat", lambda name: False)
    names = sorted({k.split(".")[0] for v in st.values() for k in v if needs(k.split(".")[0])})
    if not names:
        return
    unbuilt = [k for b in ("stale", "missing") for k in st[b] if needs(k.split(".")[0])]
    for b in ("stale", "missing"):
        st[b] = [k for k in st[b] if k not in unbuilt]
    try:
        kind, path = builder.find_coopmat_compiler()
        s.ok("cooperative-matrix kernels", f"{', '.join(names)}: built with {kind} ({path})"
             + (f"; {len(unbuilt)} variant(s) built on first use" if unbuilt else ""))
    except RuntimeError as e:
        s.info("cooperative-matrix kernels", f"{', '.join(names)} not built ({e}); only GPUs listing cooperative "
                                             "matrices run them, the others' matmuls are unaffected")


def probe(env: Mapping[str, str] | None = None) -> Section:
    """The kernels section."""
    env = os.environ if env is None else env
    s = Section("kernels", "Kernels (SPIR-V)")
    from helios.kernels_spirv import registry

    builder = registry.load_builder()  # build.py: the one place that knows kernels and variants
    st = kernel_status(registry, builder)
    _coopmat_kernels(builder, st, s)
    s.data["spirv"] = {k: v for k, v in st.items()}
    s.data["packaged_dir"] = registry.PACKAGED_SPV
    total = sum(len(v) for v in st.values())
    glslc = None
    try:
        glslc = builder.find_glslc()
    except RuntimeError:
        pass
    s.data["glslc"] = glslc
    good = len(st["current"]) + len(st["rebuilt"])
    bad = st["stale"] + st["missing"] + st["corrupt"]
    if not bad:
        extra = f", {len(st['rebuilt'])} of them rebuilt in the user cache" if st["rebuilt"] else ""
        s.ok("SPIR-V", f"all {total} kernel variants built and current ({registry.PACKAGED_SPV}){extra}")
    else:
        parts = [f"{len(st[k])} {k}" for k in ("stale", "missing", "corrupt") if st[k]]
        shown = ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
        if glslc and not st["corrupt"]:
            s.fail("SPIR-V", f"{good} of {total} current; {', '.join(parts)} ({shown}): glslc rebuilds them on first use",
                   "rebuild now: pip install -e . (or python kernels_spirv/build.py)")
        else:
            s.fail("SPIR-V", f"{good} of {total} current; {', '.join(parts)} ({shown})",
                   "apt-get install glslc, then pip install -e . (rebuilds the kernels)", required=True)
    if glslc:
        s.ok("glslc", f"{glslc} (rebuilds a kernel whose GLSL changed)")
    else:
        s.fail("glslc", "not found: an edited or generated kernel cannot be compiled",
               "apt-get install glslc (or set GLSLC=/path/to/glslc)")

    pipes = os.path.join(registry.cache_dir(), "pipelines")
    pc = s.data["pipeline_cache"] = pipeline_cache(pipes)
    if os.path.isdir(pipes) and not os.access(pipes, os.W_OK):
        s.fail("pipeline cache", f"{pipes} is not writable: pipelines are rebuilt in every process",
               f"chmod u+w {pipes}, or point XDG_CACHE_HOME at a writable folder")
    else:
        s.ok("pipeline cache", pipeline_cache_text(pc))

    mesa, note = mesa_shader_cache(env)
    if mesa is None:
        s.data["mesa_shader_cache"] = None
        s.info("Mesa shader cache", f"{note}: lavapipe recompiles every pipeline in each new process")
    else:
        files, size = dir_usage(mesa)
        s.data["mesa_shader_cache"] = {"path": mesa, "files": files, "bytes": size, "note": note}
        s.info("Mesa shader cache", f"{mesa} ({note}): {files} file(s), {human_bytes(size)}")
    return s
