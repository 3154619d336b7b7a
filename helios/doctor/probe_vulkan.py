"""The Vulkan section: loader, devices, what Helios' kernels need of them, the device Helios
would pick, lavapipe's threads, and the addon checked field by field against the bindings."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from . import vk_bindings, vk_compare
from .report import Section
from .util import cpu_count, human_bytes
from helios._kernels.core import DRIVER_LOOP_LIMIT, device_loop_run

LOADER_ADVICE = "apt-get install libvulkan1 mesa-vulkan-drivers (the Vulkan loader and lavapipe, Mesa's CPU driver)"
ADDON_ADVICE = "rebuild the addon: pip install -e . (or ./scripts/setup.sh), with libvulkan-dev and g++ installed"
DRIVER_ADVICE = "apt-get install mesa-vulkan-drivers (lavapipe runs everything on the CPU), or install your GPU's Vulkan driver"

# The kernels' fixed workgroups are 256 invocations wide (elementwise, copy, rng, adamw); the
# largest shared-memory user is matmul's GPU tile (2 x 16 x 64 floats = 8 KiB; reduce needs 3 KiB).
NEED_INVOCATIONS = 256
NEED_SHARED = 8 * 1024
LAVAPIPE_SUBGROUP = 8  # matmul's register-blocked CPU kernel (MM_SG) is compiled for 8 lanes


def _ver_tuple(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(".")[:3] if x.isdigit())


def load_addon():
    """The native addon ``helios._vulkan`` (ImportError when unbuilt or when libvulkan.so.1 is missing)."""
    from helios import _vulkan

    return _vulkan


def kernel_needs(dev: dict) -> list[tuple[str, bool, str, bool, str]]:
    """What Helios' kernels need of ``dev`` (an addon-style dict): (name, met, detail, required, advice) each."""
    lim, feat = dev["limits"], dev["features"]
    wg = list(lim["max_workgroup_size"])
    return [
        ("Vulkan >= 1.2", _ver_tuple(dev["api_version"]) >= (1, 2), f"device API {dev['api_version']}; the SPIR-V targets Vulkan 1.2",
         True, "update the driver (Mesa >= 20.2 for lavapipe) or pick another device with HELIOS_DEVICE"),
        (f"workgroups of {NEED_INVOCATIONS}", lim["max_workgroup_invocations"] >= NEED_INVOCATIONS and wg[0] >= NEED_INVOCATIONS,
         f"max {lim['max_workgroup_invocations']} invocations, size {wg}", True,
         "this device cannot run Helios' elementwise kernels; pick another with HELIOS_DEVICE"),
        (f"shared memory >= {human_bytes(NEED_SHARED)}", lim["max_shared_memory"] >= NEED_SHARED,
         f"{human_bytes(lim['max_shared_memory'])} per workgroup", True,
         "this device cannot run Helios' matmul tiles; pick another with HELIOS_DEVICE"),
        ("int64 (shaderInt64)", bool(feat["int64"]), "int64 tensors: token ids, argmax, embedding and loss indices", False,
         "int64 tensors fail on this device: use int32 indices, or another device"),
        ("16-bit storage", bool(feat["storage16"]), "float16 / bfloat16 tensors", False,
         "float16/bfloat16 tensors fail on this device: train in float32, or use another device"),
        ("8-bit storage", bool(feat["storage8"]), "bool tensors (masks, comparisons)", False,
         "bool tensors fail on this device: use another device"),
        ("timestamps", lim["timestamp_valid_bits"] > 0, f"{lim['timestamp_valid_bits']} valid bits, period {lim['timestamp_period']} ns",
         False, "the profiler and HELIOS_DEBUG get no per-kernel device times here; step timers still work"),
    ]


def coopmat_text(dev: dict, extra: dict | None) -> str:
    """The cooperative-matrix line of ``dev`` (an addon-style dict; ``extra`` the bindings' extra facts or
    None): the shapes and types it lists and whether Helios' matmul uses them (helios._kernels.coopmat
    decides, here for a 4096^3 product of each 16-bit dtype), and flash attention of each (head dim 64)."""
    from helios._kernels import coopmat

    listed = coopmat.shapes_of(dev)
    if listed:
        lim = dev["limits"]
        choice = {dt: coopmat.choose(listed, dt, 4096, 4096, 4096, int(lim["subgroup_size"]), int(lim["max_shared_memory"]),
                                     coopmat.kernel_built()) for dt in ("float16", "bfloat16")}
        uses = "; ".join(f"{dt}: " + (f"used ({c.tile.label()})" if c.coopmat else f"not used ({c.reason})")
                         for dt, c in choice.items())
        flash = {dt: coopmat.choose_flash(listed, dt, 64, int(lim["subgroup_size"]), int(lim["max_shared_memory"]),
                                          coopmat.kernel_built(coopmat.FLASH_KERNEL)) for dt in ("float16", "bfloat16")}
        attn = "; ".join(f"{dt} flash attention: " + (f"used ({f.plan(0).label()} forward)" if f.coopmat else f"not used ({f.reason})")
                         for dt, f in flash.items())
        return f"{', '.join(x.label() for x in listed)} -- {uses}; {attn}"
    if extra and (extra.get("cooperative_matrix_khr") or extra.get("cooperative_matrix_nv")):
        shapes = ", ".join(extra.get("cooperative_matrix_shapes", [])[:8])
        return (f"the driver has it{' (' + shapes + ')' if shapes else ''}, but not used: Helios' coopmat kernel needs "
                "VK_KHR_cooperative_matrix with Vulkan 1.3 and vulkanMemoryModel")
    return "none listed (not used: matmul runs Helios' GLSL kernels)"


def _describe_memory(extra: dict) -> str:
    heaps = ", ".join(f"heap{i} {human_bytes(h['size'])}{' device-local' if h['device_local'] else ''}"
                      for i, h in enumerate(extra["memory_heaps"]))
    kinds = []
    for i, t in enumerate(extra["memory_types"]):
        flags = [n for n, on in (("device-local", t["device_local"]), ("host-visible", t["host_visible"]),
                                 ("coherent", t["host_coherent"]), ("cached", t["host_cached"])) if on]
        kinds.append(f"type{i}@heap{t['heap']} {'+'.join(flags) or 'none'}")
    return f"{heaps}; {', '.join(kinds)}"


def _pick(env: Mapping[str, str], devices: list[dict], s: Section) -> None:
    """Which device Helios would use, and why (``HELIOS_DEVICE`` honoured, as ``get_runtime`` does)."""
    names = ", ".join(f"vulkan:{d['index']} ({d['name']})" for d in devices)
    spec = env.get("HELIOS_DEVICE")
    order = "the first in Helios' order (discrete > integrated > virtual > cpu)"
    if spec is None:
        d = devices[0]
        s.data["picked"] = d["index"]
        s.ok("device Helios would use", f"vulkan:0 ({d['name']}, {d['type']}): {order}; HELIOS_DEVICE is unset")
        return
    kind, sep, num = spec.strip().partition(":")
    if kind != "vulkan" or (sep and not num.isdigit()):
        s.data["picked"] = None
        s.fail("device Helios would use", f"HELIOS_DEVICE={spec!r} is not 'vulkan' or 'vulkan:N'",
               f"set HELIOS_DEVICE to one of: {names}", required=True)
        return
    idx = int(num) if sep else 0
    if idx >= len(devices):
        s.data["picked"] = None
        s.fail("device Helios would use", f"HELIOS_DEVICE={spec} names no device ({len(devices)} here)",
               f"unset HELIOS_DEVICE or set it to one of: {names}", required=True)
        return
    d = devices[idx]
    s.data["picked"] = idx
    s.ok("device Helios would use", f"vulkan:{idx} ({d['name']}, {d['type']}): HELIOS_DEVICE={spec}")


def _lavapipe_threads(env: Mapping[str, str], devices: list[dict], s: Section) -> None:
    """LP_NUM_THREADS: lavapipe's rasterizer/compute threads (default: one per CPU)."""
    if not any(d["type"] == "cpu" for d in devices):
        return
    cpus = cpu_count()
    raw = env.get("LP_NUM_THREADS")
    local = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_NTASKS_PER_NODE") or env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    s.data["lp_num_threads"] = raw
    s.data["cpus"] = cpus
    if raw is None:
        ranks = int(local) if local and local.isdigit() else 1
        if ranks > 1:
            s.fail("lavapipe threads", f"LP_NUM_THREADS unset: each of {ranks} local ranks starts {cpus} threads on {cpus} CPUs",
                   f"export LP_NUM_THREADS={max(1, cpus // ranks)} (CPUs / ranks per host) before launching")
        else:
            s.ok("lavapipe threads", f"LP_NUM_THREADS unset: lavapipe uses one thread per CPU ({cpus} here)")
        return
    if not raw.strip().isdigit():
        s.fail("lavapipe threads", f"LP_NUM_THREADS={raw!r} is not a number", f"export LP_NUM_THREADS=<1..{cpus}> or unset it")
    elif int(raw) > cpus:
        s.fail("lavapipe threads", f"LP_NUM_THREADS={raw} exceeds the {cpus} CPUs this process may use",
               f"export LP_NUM_THREADS={cpus} or fewer (oversubscribed threads slow every kernel)")
    else:
        note = " (0: lavapipe runs kernels on the calling thread)" if int(raw) == 0 else ""
        s.ok("lavapipe threads", f"LP_NUM_THREADS={raw} of {cpus} CPUs{note}")


def _device_lines(d: dict, extra: dict | None, s: Section) -> None:
    tag = f"vulkan:{d['index']}"
    lim, feat = d["limits"], d["features"]
    drv = f"driver {extra['driver_name']} ({extra['driver_info']})" if extra and extra.get("driver_name") else \
        f"driverVersion {d['driver_version']}"
    s.info(tag, f"{d['name']} [{d['type']}], {drv}, Vulkan {d['api_version']}, "
                f"vendor 0x{d['vendor_id']:04x} device 0x{d['device_id']:04x}")
    if extra:
        s.info(f"{tag} memory", _describe_memory(extra) + (" (unified: Helios maps it, no staging copies)"
                                                          if feat["unified_memory"] else " (Helios stages host transfers)"))
        sg = f"subgroup {lim['subgroup_size']}"
        if extra.get("subgroup_size_min") is not None:
            sg += f" (range {extra['subgroup_size_min']}..{extra['subgroup_size_max']})"
    else:
        s.info(f"{tag} memory", f"{human_bytes(d['device_local_bytes'])} device-local; unified: {feat['unified_memory']} "
                                f"(heaps and types: install the bindings)")
        sg = f"subgroup {lim['subgroup_size']}"
    s.info(f"{tag} compute", f"{sg}; workgroup max {lim['max_workgroup_invocations']} invocations, size "
                             f"{list(lim['max_workgroup_size'])}; shared {human_bytes(lim['max_shared_memory'])}; "
                             f"maxStorageBufferRange {human_bytes(lim['max_storage_buffer_range'])} (larger tensors are "
                             f"bound in windows); push descriptors {'yes' if feat['push_descriptor'] else 'no'}")
    arith = f"float16 {'yes' if feat['float16'] else 'no'}, int16 {'yes' if feat['int16'] else 'no'} " \
            "(not needed: Helios' kernels load 16-bit values and compute in float32)"
    s.info(f"{tag} 16-bit arithmetic", arith)
    s.info(f"{tag} cooperative matrix", coopmat_text(d, extra))
    if d["type"] == "cpu" and lim["subgroup_size"] == LAVAPIPE_SUBGROUP:
        s.ok(f"{tag} CPU matmul", f"subgroup size {LAVAPIPE_SUBGROUP}: matmul uses its register-blocked CPU kernel")
    run = device_loop_run(d)
    if run is not None:
        s.info(f"{tag} loops", f"the driver ends an invocation's loops after {DRIVER_LOOP_LIMIT:,} iterations in all; Helios keeps each "
                               f"loop under {run:,} (long column reductions and products go in runs, long rows on "
                               f"bigger workgroups, rows too long for those refused)")
    for name, met, detail, required, advice in kernel_needs(d):
        if met:
            s.ok(f"{tag} {name}", detail)
        else:
            s.fail(f"{tag} {name}", detail, advice, required=required)


def probe(env: Mapping[str, str] | None = None, addon_loader: Callable = load_addon,
          bindings_reader: Callable = vk_bindings.read_devices) -> Section:
    """The Vulkan section.  ``addon_loader`` and ``bindings_reader`` are the two witnesses (replaced by tests
    to fake a missing loader, addon or bindings)."""
    env = os.environ if env is None else env
    s = Section("vulkan", "Vulkan")
    # The second opinion first: it also says which loader library is there and its version.
    bindings = None
    try:
        bindings = bindings_reader()
        s.data["bindings"] = bindings
        s.ok("loader", f"libvulkan {bindings['loader_version']} ({bindings['loader_library'] or 'path unknown'}); "
                       f"instance API {bindings['instance_api']}")
    except ImportError as e:
        s.data["bindings"] = None
        s.fail("vulkan bindings", f"not installed ({e})", vk_bindings.INSTALL_HINT)
    except OSError as e:  # the bindings import but cannot dlopen libvulkan.so.1
        s.data["bindings"] = None
        s.fail("loader", f"no Vulkan loader: libvulkan.so.1 cannot be loaded ({e})", LOADER_ADVICE, required=True)
    except Exception as e:  # noqa: BLE001 - a Vulkan failure is a finding, never a crash
        s.data["bindings"] = None
        s.fail("vulkan bindings", f"reading Vulkan through the bindings failed: {type(e).__name__}: {e}", DRIVER_ADVICE)

    try:
        addon = addon_loader()
    except ImportError as e:
        s.data["addon"] = None
        missing_loader = "libvulkan" in str(e)
        s.fail("native addon", f"helios._vulkan does not load ({e})", LOADER_ADVICE if missing_loader else ADDON_ADVICE,
               required=True)
        return s
    devices = [dict(d) for d in addon.enumerate_devices()]
    s.data["addon"] = devices
    if not devices:
        reason = addon.last_error() if hasattr(addon, "last_error") else "no device"
        s.fail("devices", f"the addon finds no Vulkan device ({reason})", DRIVER_ADVICE, required=True)
        return s
    s.ok("devices", f"{len(devices)}: " + ", ".join(f"vulkan:{d['index']} {d['name']} ({d['type']})" for d in devices))

    extras = {}
    if bindings is not None:
        extras = {d["index"]: d["extra"] for d in bindings["devices"]}
        diffs, unchecked = vk_compare.compare(devices, bindings["devices"])
        s.data["disagreements"] = [x.as_dict() for x in diffs]
        s.data["unchecked_fields"] = unchecked
        if diffs:
            for x in diffs:
                s.fail("addon vs bindings", x.text(),
                       "a bug in the addon's device query (helios/native/instance.cpp) or in the driver: report it with --json")
        else:
            n = sum(vk_compare.count_fields(d) for d in devices) - len(unchecked) * len(devices)
            s.ok("addon vs bindings", f"agree on all {n} fields of {len(devices)} device(s)"
                                      + (f" ({len(unchecked)} not checked: {', '.join(unchecked)})" if unchecked else ""))
    for d in devices:
        _device_lines(d, extras.get(d["index"]), s)
    _pick(env, devices, s)
    _lavapipe_threads(env, devices, s)
    return s
