"""The Python section: interpreter, numpy, Helios' version and install mode, optional packages, cache folders."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Mapping

from .report import Section
from .util import dir_usage, human_bytes

# Optional distributions and what each one adds; torch is only the test suite's oracle.
OPTIONAL = {
    "vulkan": "the doctor's second opinion on Vulkan (helios[doctor])",
    "cuda-bindings": "the CUDA driver API for PTX kernels (helios[cuda])",
    "cffi": "the ibverbs transport (helios[ibverbs])",
    "tqdm": "progress bars",
    "torch": "test oracle only, never used at run time",
    "pytest": "the test suite",
    "ruff": "the linter",
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_mode() -> tuple[str, str]:
    """("editable" | "wheel" | "source tree", where): how the running ``helios`` was installed."""
    import helios

    where = os.path.dirname(os.path.abspath(helios.__file__))
    # A source checkout's helios.egg-info can shadow the installed record when the checkout is the
    # working directory, so look at every "helios" distribution, not the first found.
    dists = list(importlib.metadata.distributions(name="helios"))
    for dist in dists:
        raw = dist.read_text("direct_url.json")
        try:
            if raw and json.loads(raw).get("dir_info", {}).get("editable"):
                return "editable", where
        except ValueError:
            pass
    if not dists:
        return "source tree (not installed)", where
    return ("wheel" if "site-packages" in where or "dist-packages" in where else "source tree"), where


def cache_folders(env: Mapping[str, str]) -> dict[str, str]:
    """Each Helios cache folder by kind, resolved as the code that writes it resolves it (nothing is created)."""
    xdg = os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "helios")
    data = env.get("HELIOS_CACHE_DIR") or xdg
    # Data caches follow HELIOS_CACHE_DIR (helios.fileio.cache_dir); the kernel caches live under XDG only.
    return {"tokens": os.path.join(data, "tokens"), "tokenizers": os.path.join(data, "tokenizers"),
            "spv": os.path.join(xdg, "spv"), "pipelines": os.path.join(xdg, "pipelines"), "cubin": os.path.join(xdg, "cubin"),
            "ptx": os.path.join(xdg, "ptx")}


def probe(env: Mapping[str, str] | None = None) -> Section:
    """The Python section."""
    env = os.environ if env is None else env
    s = Section("python", "Python")
    py = sys.version_info
    s.data["python"] = {"version": platform.python_version(), "executable": sys.executable}
    if py >= (3, 10):
        s.ok("python", f"{platform.python_version()} ({sys.executable})")
    else:
        s.fail("python", f"{platform.python_version()} is older than 3.10", "use Python 3.10 or newer", required=True)
    np_ver = _version("numpy")
    s.data["numpy"] = np_ver
    if np_ver:
        s.ok("numpy", np_ver)
    else:
        s.fail("numpy", "not installed", "pip install -e . (installs numpy)", required=True)
    mode, where = install_mode()
    s.data["helios"] = {"version": _version("helios"), "install": mode, "path": where}
    s.ok("helios", f"{_version('helios') or '?'}, {mode} ({where})")
    s.data["optional"] = {name: _version(name) for name in OPTIONAL}
    for name, why in OPTIONAL.items():
        v = s.data["optional"][name]
        s.info(name, f"{v} - {why}" if v else f"not installed - {why}")

    # Variables that change what Helios does: a forgotten export is a classic cause of "it was fast yesterday".
    knobs = {k: v for k, v in sorted(env.items()) if k.startswith(("HELIOS_", "LP_", "MESA_", "VK_")) or k == "XDG_CACHE_HOME"}
    s.data["environment"] = knobs
    s.info("environment", ", ".join(f"{k}={v}" for k, v in knobs.items()) if knobs else
           "no HELIOS_*, LP_*, MESA_*, VK_* variables set (defaults everywhere)")

    folders = cache_folders(env)
    s.data["caches"] = {}
    for kind, path in folders.items():
        files, size = dir_usage(path)
        s.data["caches"][kind] = {"path": path, "files": files, "bytes": size}
    moved = " (HELIOS_CACHE_DIR moves tokens and tokenizers only)" if env.get("HELIOS_CACHE_DIR") else ""
    s.info("caches", "; ".join(f"{k} {human_bytes(v['bytes'])}" for k, v in s.data["caches"].items())
           + f" under {os.path.commonpath(list(folders.values()))}{moved}")
    return s
