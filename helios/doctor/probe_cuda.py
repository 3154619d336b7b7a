"""The CUDA section: driver and GPUs (with compute capability), ptxas / nvdisasm / cuobjdump, and the
PTX ladder assembled here for every target it names (the gate's quick form: ptxas only, no SASS or
emulation checks)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import tempfile
from collections.abc import Callable

from .report import Section
from .util import human_bytes, tool_version

NO_DRIVER_ADVICE = ("PTX kernels need an NVIDIA GPU and its driver (libcuda.so.1); without one they are still "
                    "generated and gated here, and HELIOS_CUDA_DEVICE=emulator runs them on the CPU emulator")
TOOL_ADVICE = {
    "ptxas": "pip install nvidia-cuda-nvcc (or the CUDA toolkit), or set HELIOS_PTXAS",
    "nvdisasm": "pip install nvidia-cuda-nvdisasm, or set HELIOS_NVDISASM",
    "cuobjdump": "pip install nvidia-cuda-cuobjdump, or set HELIOS_CUOBJDUMP",
}


def driver_status() -> tuple[bool, str]:
    """(usable, reason) from :func:`helios.cuda_ptx.driver.driver_status` (cuInit and a device)."""
    from helios.cuda_ptx import driver

    return driver.driver_status()


def list_gpus(cu=None) -> dict:
    """Driver version and every GPU: name, compute capability ("sm_90"), memory.  Needs a working driver;
    ``cu`` is the driver module (``cuda.bindings.driver`` unless given, e.g. the emulated one)."""
    if cu is None:
        from cuda.bindings import driver as cu

    def ok(r):
        if r[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA call failed: {r[0]}")
        return r[1] if len(r) == 2 else r[1:]

    ver = ok(cu.cuDriverGetVersion())
    gpus = []
    A = cu.CUdevice_attribute
    for i in range(ok(cu.cuDeviceGetCount())):
        dev = ok(cu.cuDeviceGet(i))
        name = ok(cu.cuDeviceGetName(64, dev))
        major = ok(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = ok(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        gpus.append({"index": i, "name": name.split(b"\0", 1)[0].decode(errors="replace"), "sm": f"sm_{major}{minor}",
                     "memory": int(ok(cu.cuDeviceTotalMem(dev)))})
    return {"driver_version": f"{ver // 1000}.{ver % 1000 // 10}", "gpus": gpus}


def find_tool(name: str) -> str | None:
    """Where Helios finds ``name`` (``$HELIOS_<NAME>``, PATH, the NVIDIA wheels)."""
    from helios.cuda_ptx import toolchain

    return toolchain.find_tool(name)


def ladder_quick_gate(ptxas: str) -> list[dict]:
    """Assemble every rung of the gate's ladder with ``ptxas -v -O3`` into a temporary folder (not the
    cubin cache, so this proves the ptxas here works); judge spills and the forbidden ptxas notes."""
    from helios.cuda_ptx import gate, toolchain
    from helios.cuda_ptx.emit import emit_gemm

    out = []
    with tempfile.TemporaryDirectory(prefix="helios-doctor-") as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        for name, cfg in gate.gate_configs().items():
            row = {"rung": name, "target": cfg.target, "ok": False, "problem": ""}
            try:
                with open(src, "w") as f:
                    f.write(emit_gemm(cfg))
                r = subprocess.run([ptxas, f"-arch={cfg.target}", "-v", "-O3", src, "-o", cubin],
                                   capture_output=True, text=True, timeout=120, check=False)
                info = toolchain.parse_ptxas_log(r.stdout + r.stderr)
                bad = [n for n in info.notes if n in gate.FORBIDDEN_NOTES]
                if r.returncode != 0:
                    last = (r.stderr.strip().splitlines() or ["no message"])[-1]
                    row["problem"] = f"ptxas rejected it: {last}"
                elif info.spill_stores or info.spill_loads or info.stack_frame:
                    row["problem"] = f"spills ({info.spill_stores} B stores, {info.spill_loads} B loads, stack {info.stack_frame} B)"
                elif bad:
                    row["problem"] = "ptxas notes " + ", ".join(bad)
                else:
                    row["ok"], row["registers"] = True, info.registers
            except Exception as e:  # noqa: BLE001 - one rung's failure is a finding, not the end of the report
                row["problem"] = f"{type(e).__name__}: {e}"
            out.append(row)
    return out


def probe(driver: Callable = driver_status, gpus: Callable = list_gpus, tool: Callable = find_tool,
          ladder: Callable = ladder_quick_gate, run_ladder: bool = True) -> Section:
    """The CUDA section; the callables are the probes (tests replace them to fake a missing driver or tool)."""
    s = Section("cuda", "CUDA (PTX backend)")
    try:
        s.data["cuda_bindings"] = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        s.data["cuda_bindings"] = None
    usable, why = driver()
    s.data["driver"] = {"usable": usable, "reason": why}
    if usable:
        try:
            g = gpus()
            s.data.update(g)
            s.ok("driver", f"CUDA driver {g['driver_version']}, {len(g['gpus'])} GPU(s)")
            for d in g["gpus"]:
                s.info(f"cuda:{d['index']}", f"{d['name']}, {d['sm']}, {human_bytes(d['memory'])}"
                       + (" (wgmma/TMA rungs run here)" if d["sm"] == "sm_90" else ""))
        except Exception as e:  # noqa: BLE001
            s.fail("driver", f"the driver initialised but listing GPUs failed ({type(e).__name__}: {e})", NO_DRIVER_ADVICE)
    elif s.data["cuda_bindings"] is None:
        s.fail("driver", "cuda-bindings is not installed, so no CUDA driver can be used",
               "pip install 'helios[cuda]' (cuda-bindings); a GPU and its driver are needed to run PTX kernels")
    else:
        # cuda-bindings imports without a driver; cuInit is what finds libcuda.so.1 missing.
        short = "no driver: libcuda.so.1 is not installed" if "no CUDA driver" in why else why
        s.fail("driver", f"{short} (cuda-bindings {s.data['cuda_bindings']})", NO_DRIVER_ADVICE)

    if os.environ.get("HELIOS_CUDA_DEVICE", "").startswith("emulator"):
        s.info("HELIOS_CUDA_DEVICE", f"{os.environ['HELIOS_CUDA_DEVICE']}: CUDA kernels run on the CPU emulator (slow, exact)")

    tools = {}
    for name in ("ptxas", "nvdisasm", "cuobjdump"):
        path = tool(name)
        if path is None:
            tools[name] = None
            s.fail(name, "not found", TOOL_ADVICE[name])
            continue
        try:
            ver = tool_version(path)
        except (OSError, subprocess.SubprocessError) as e:
            tools[name] = {"path": path, "version": None}
            s.fail(name, f"{path} does not run ({e})", TOOL_ADVICE[name])
            continue
        tools[name] = {"path": path, "version": ver}
        s.ok(name, f"{ver} ({path})")
    s.data["tools"] = tools

    if not run_ladder:
        s.info("PTX ladder", "not assembled (--no-ptx)")
    elif tools.get("ptxas") is None or tools["ptxas"]["version"] is None:
        s.fail("PTX ladder", "cannot be assembled here without ptxas", TOOL_ADVICE["ptxas"])
    else:
        rows = ladder(tools["ptxas"]["path"])
        s.data["ladder"] = rows
        targets = sorted({r["target"] for r in rows})
        failed = [r for r in rows if not r["ok"]]
        if failed:
            for r in failed:
                s.fail(f"PTX {r['rung']}", f"{r['target']}: {r['problem']}",
                       "run the full gate for details: python -m helios.cuda_ptx.gate " + r["rung"])
        else:
            s.ok("PTX ladder", f"all {len(rows)} rungs assemble for {', '.join(targets)} with no spills "
                               "(quick form; the full gate: python -m helios.cuda_ptx.gate)")
    return s
