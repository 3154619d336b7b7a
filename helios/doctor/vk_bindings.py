"""Vulkan as the ``vulkan`` PyPI bindings (a cffi binding of the loader) see it: the doctor's second opinion.

Nothing here touches Helios' native addon.  :func:`read_devices` walks the same Vulkan
queries the addon makes (``helios/native/instance.cpp``) with the same rules -- the API
version capped by the instance's, the same property/feature chains, the same compute
queue family choice, the same device order -- so that each field of the addon's
``enumerate_devices()`` dict can be recomputed independently and compared.  It also reads
what the addon does not report (driver name, memory heaps and types, the subgroup size
range, cooperative-matrix support, 16-bit arithmetic).

The structs are built with the binding's ``ffi`` and the calls go to its ``lib`` directly:
the binding's Python wrappers cannot chain ``pNext`` structs.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

INSTALL_HINT = "pip install 'helios[doctor]' (the `vulkan` bindings, an independent check of the addon)"

# VkPhysicalDeviceType -> (the addon's name, its sort rank): discrete first, lavapipe ("cpu") late.
_TYPES = {2: ("discrete", 0), 1: ("integrated", 1), 3: ("virtual", 2), 4: ("cpu", 3)}
_DEVICE_LOCAL, _HOST_VISIBLE, _HOST_COHERENT, _HOST_CACHED = 0x1, 0x2, 0x4, 0x8
_HEAP_DEVICE_LOCAL = 0x1
_STAGE_COMPUTE = 0x20  # VK_SHADER_STAGE_COMPUTE_BIT
_QUEUE_GRAPHICS, _QUEUE_COMPUTE = 0x1, 0x2
_TIME_DOMAIN_DEVICE, _TIME_DOMAIN_CLOCK_MONOTONIC = 0, 1
_VENDOR_NVIDIA = 0x10DE


def load():
    """The ``vulkan`` module; raises ImportError (not installed) or OSError (no libvulkan.so.1)."""
    import vulkan  # noqa: F401 - imported for its side effect of loading libvulkan.so.1

    return vulkan


def version_string(v: int) -> str:
    """A packed Vulkan version (VK_MAKE_API_VERSION) as "major.minor.patch", as the addon prints it."""
    return f"{(v >> 22) & 0x7F}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


def driver_version_string(vendor_id: int, v: int) -> str:
    """A driverVersion in the vendor's own packing (NVIDIA uses 10.8.8.6 bits; Mesa and most use Vulkan's)."""
    if vendor_id == _VENDOR_NVIDIA:
        return f"{(v >> 22) & 0x3FF}.{(v >> 14) & 0xFF}.{(v >> 6) & 0xFF}.{v & 0x3F}"
    return version_string(v)


def loader_library() -> str | None:
    """The path of the libvulkan this process loaded (from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "libvulkan.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


class _Reader:
    """One instance of the bindings' loader and the queries on its physical devices."""

    def __init__(self, vk) -> None:
        self.vk, self.ffi, self.lib = vk, vk.ffi, vk.lib
        ffi, lib = self.ffi, self.lib
        ver = ffi.new("uint32_t *", 0x400000)  # a 1.0 loader lacks vkEnumerateInstanceVersion
        try:
            lib.vkEnumerateInstanceVersion(ver)
        except AttributeError:
            pass
        self.loader_version = ver[0]
        self._keep = []  # cffi objects that must outlive the calls that point at them
        app = self._new("VkApplicationInfo", sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO,
                        pApplicationName=self._str("helios-doctor"), pEngineName=self._str("helios"),
                        apiVersion=min(self.loader_version, (1 << 22) | (3 << 12)))
        self.instance_api = app.apiVersion
        ci = self._new("VkInstanceCreateInfo", sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, pApplicationInfo=app)
        # Portability drivers (MoltenVK) are listed only when asked for, as the addon asks.
        if "VK_KHR_portability_enumeration" in self.instance_extensions():
            names = ffi.new("char *[]", [self._str("VK_KHR_portability_enumeration")])
            self._keep.append(names)
            ci.enabledExtensionCount, ci.ppEnabledExtensionNames = 1, names
            ci.flags = 0x1  # VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR
        inst = ffi.new("VkInstance *")
        r = lib.vkCreateInstance(ci, ffi.NULL, inst)
        if r != 0:
            raise RuntimeError(f"vkCreateInstance failed (VkResult {r})")
        self.instance = inst[0]

    def close(self) -> None:
        """Destroy the instance."""
        self.lib.vkDestroyInstance(self.instance, self.ffi.NULL)

    def _new(self, ctype: str, **fields):
        obj = self.ffi.new(ctype + " *")
        for k, v in fields.items():
            setattr(obj, k, v)
        return obj

    def _structs(self, **specs: tuple[str, str]) -> SimpleNamespace:
        """New zeroed structs by name, each given as (C type, its sType without VK_STRUCTURE_TYPE_)."""
        return SimpleNamespace(**{name: self._new(ctype, sType=getattr(self.vk, "VK_STRUCTURE_TYPE_" + stype))
                                  for name, (ctype, stype) in specs.items()})

    def _str(self, s: str):
        b = self.ffi.new("char[]", s.encode())
        self._keep.append(b)
        return b

    def _chain(self, head, *links):
        """Link ``head -> links[0] -> links[1] ...`` through pNext."""
        prev = head
        for link in links:
            prev.pNext = link
            prev = link

    def instance_extensions(self) -> set[str]:
        """Names of the loader's instance extensions."""
        n = self.ffi.new("uint32_t *")
        self.lib.vkEnumerateInstanceExtensionProperties(self.ffi.NULL, n, self.ffi.NULL)
        arr = self.ffi.new("VkExtensionProperties[]", n[0])
        self.lib.vkEnumerateInstanceExtensionProperties(self.ffi.NULL, n, arr)
        return {self.ffi.string(arr[i].extensionName).decode() for i in range(n[0])}

    def physical_devices(self) -> list:
        """The loader's physical devices, in its own order."""
        n = self.ffi.new("uint32_t *")
        r = self.lib.vkEnumeratePhysicalDevices(self.instance, n, self.ffi.NULL)
        if r < 0:
            raise RuntimeError(f"vkEnumeratePhysicalDevices failed (VkResult {r})")
        arr = self.ffi.new("VkPhysicalDevice[]", n[0])
        self.lib.vkEnumeratePhysicalDevices(self.instance, n, arr)
        return [arr[i] for i in range(n[0])]

    def device_extensions(self, pd) -> set[str]:
        """Names of ``pd``'s device extensions."""
        n = self.ffi.new("uint32_t *")
        self.lib.vkEnumerateDeviceExtensionProperties(pd, self.ffi.NULL, n, self.ffi.NULL)
        arr = self.ffi.new("VkExtensionProperties[]", n[0])
        self.lib.vkEnumerateDeviceExtensionProperties(pd, self.ffi.NULL, n, arr)
        return {self.ffi.string(arr[i].extensionName).decode() for i in range(n[0])}

    def _proc(self, name: str, pfn_type: str):
        fp = self.lib.vkGetInstanceProcAddr(self.instance, name.encode())
        return None if fp == self.ffi.NULL else self.ffi.cast(pfn_type, fp)

    def _calibrated(self, pd) -> bool:
        """Whether ``pd`` calibrates its timestamps against CLOCK_MONOTONIC (the addon's rule: both
        the device and the monotonic domains listed)."""
        ffi = self.ffi
        get = self._proc("vkGetPhysicalDeviceCalibrateableTimeDomainsEXT", "PFN_vkGetPhysicalDeviceCalibrateableTimeDomainsEXT")
        if get is None:
            return False
        n = ffi.new("uint32_t *")
        get(pd, n, ffi.NULL)
        doms = ffi.new("VkTimeDomainKHR[]", n[0])
        get(pd, n, doms)
        found = {int(doms[i]) for i in range(n[0])}
        return _TIME_DOMAIN_DEVICE in found and _TIME_DOMAIN_CLOCK_MONOTONIC in found

    def _memory(self, pd) -> tuple[list[dict], list[dict]]:
        """``pd``'s memory heaps (size, device-local) and memory types (heap and property flags)."""
        mem = self.ffi.new("VkPhysicalDeviceMemoryProperties *")
        self.lib.vkGetPhysicalDeviceMemoryProperties(pd, mem)
        heaps = [{"size": int(mem.memoryHeaps[h].size), "device_local": bool(mem.memoryHeaps[h].flags & _HEAP_DEVICE_LOCAL)}
                 for h in range(mem.memoryHeapCount)]
        types = []
        for t in range(mem.memoryTypeCount):
            fl = mem.memoryTypes[t].propertyFlags
            types.append({"heap": int(mem.memoryTypes[t].heapIndex), "device_local": bool(fl & _DEVICE_LOCAL),
                          "host_visible": bool(fl & _HOST_VISIBLE), "host_coherent": bool(fl & _HOST_COHERENT),
                          "host_cached": bool(fl & _HOST_CACHED)})
        return heaps, types

    def describe(self, pd) -> dict | None:
        """The addon's dict for ``pd`` (same keys, same rules) plus an ``extra`` dict; None if ``pd`` has no compute queue."""
        ffi, lib = self.ffi, self.lib
        base = ffi.new("VkPhysicalDeviceProperties *")
        lib.vkGetPhysicalDeviceProperties(pd, base)
        api = min(base.apiVersion, self.instance_api)
        v11, v12, v13 = api >= (1 << 22 | 1 << 12), api >= (1 << 22 | 2 << 12), api >= (1 << 22 | 3 << 12)
        exts = self.device_extensions(pd)
        props = self._properties2(pd, exts, v11, v12, v13)
        feats = self._features2(pd, exts, v11, v12, v13)
        calibrated = "VK_EXT_calibrated_timestamps" in exts and self._calibrated(pd)
        heaps, types = self._memory(pd)
        local = [h for h, hp in enumerate(heaps) if hp["device_local"]]
        largest = max(local, key=lambda h: heaps[h]["size"]) if local else -1
        unified = any(t["device_local"] and t["host_visible"] and t["heap"] == largest for t in types)

        family, ts_bits, families = self._queue_family(pd)
        if family is None:
            return None
        name, rank = _TYPES.get(int(base.deviceType), ("other", 4))
        coop_list = self._coop_list(pd) if "VK_KHR_cooperative_matrix" in exts and feats.coop_khr.cooperativeMatrix else []
        # The addon's rule: the shapes are listed where Helios' coopmat kernels can run (Vulkan 1.3, the
        # extension's feature and vulkanMemoryModel), else []; bf16 ones where VK_KHR_shader_bfloat16's
        # features are there too (these bindings predate its feature struct: the extension stands for them).
        usable = v13 and bool(coop_list) and bool(feats.vmm.vulkanMemoryModel)
        if "VK_KHR_shader_bfloat16" not in exts:
            coop_list = [c for c in coop_list if "bf16" not in (c["a"], c["b"])]
        return {
            "name": ffi.string(base.deviceName).decode(errors="replace"),
            "type": name,
            "vendor_id": int(base.vendorID),
            "device_id": int(base.deviceID),
            "driver_version": int(base.driverVersion),
            "api_version": version_string(base.apiVersion),
            "pipeline_cache_uuid": bytes(ffi.buffer(base.pipelineCacheUUID, 16)).hex(),
            "limits": _limits(base.limits, props, feats, ts_bits, v11, v13),
            "features": {
                "float16": bool(feats.f16.shaderFloat16),
                "storage16": bool(feats.s16.storageBuffer16BitAccess),
                "storage8": bool(feats.s8.storageBuffer8BitAccess),
                "int64": bool(feats.f2.features.shaderInt64),
                "int16": bool(feats.f2.features.shaderInt16),
                "push_descriptor": "VK_KHR_push_descriptor" in exts and v11,
                "calibrated_timestamps": calibrated,
                "unified_memory": unified,
            },
            "device_local_bytes": sum(heaps[h]["size"] for h in local),
            "cooperative_matrix": coop_list if usable else [],
            "_rank": rank,
            "extra": {
                **self._driver_extra(base, api, props, v11, v13),
                "memory_heaps": heaps,
                "memory_types": types,
                "shader_int8": bool(feats.f16.shaderInt8),
                **_cooperative_extra(exts, feats, coop_list),
                "queue_family": family,
                "queue_families": families,
                "extensions_of_interest": sorted(exts & _EXTENSIONS_OF_INTEREST),
            },
        }

    def _driver_extra(self, base, api: int, props: SimpleNamespace, v11: bool, v13: bool) -> dict:
        """The doctor's own fields on the driver, the API it is used at and the subgroup limits."""
        ffi, L = self.ffi, base.limits
        have_driver, have_sgsize = props.have_driver and v11, props.have_sgsize and v11
        return {
            "driver_name": ffi.string(props.driver.driverName).decode(errors="replace") if have_driver else "",
            "driver_info": ffi.string(props.driver.driverInfo).decode(errors="replace") if have_driver else "",
            "driver_version_text": driver_version_string(int(base.vendorID), int(base.driverVersion)),
            "effective_api_version": version_string(api),
            "subgroup_size_min": int(props.sgsize.minSubgroupSize) if have_sgsize else None,
            "subgroup_size_max": int(props.sgsize.maxSubgroupSize) if have_sgsize else None,
            "max_compute_workgroup_subgroups": int(props.sgsize.maxComputeWorkgroupSubgroups) if have_sgsize else None,
            "timestamp_compute_and_graphics": bool(L.timestampComputeAndGraphics),
            "max_buffer_size": int(props.maint4.maxBufferSize) if v13 else None,
        }

    def _properties2(self, pd, exts: set, v11: bool, v12: bool, v13: bool) -> SimpleNamespace:
        """The property structs ``describe`` reads, filled by one vkGetPhysicalDeviceProperties2 where
        Vulkan 1.1 is there (each struct chained only where its version or extension is): subgroup,
        maint3, maint4, driver, sgsize, and have_driver / have_sgsize (whether those two were asked for)."""
        p = self._structs(
            subgroup=("VkPhysicalDeviceSubgroupProperties", "PHYSICAL_DEVICE_SUBGROUP_PROPERTIES"),
            maint3=("VkPhysicalDeviceMaintenance3Properties", "PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES"),
            maint4=("VkPhysicalDeviceMaintenance4Properties", "PHYSICAL_DEVICE_MAINTENANCE_4_PROPERTIES"),
            pushp=("VkPhysicalDevicePushDescriptorPropertiesKHR", "PHYSICAL_DEVICE_PUSH_DESCRIPTOR_PROPERTIES_KHR"),
            driver=("VkPhysicalDeviceDriverProperties", "PHYSICAL_DEVICE_DRIVER_PROPERTIES"),
            sgsize=("VkPhysicalDeviceSubgroupSizeControlProperties", "PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES"))
        p.have_driver = v12 or "VK_KHR_driver_properties" in exts
        p.have_sgsize = v13 or "VK_EXT_subgroup_size_control" in exts
        if v11:
            props2 = self._new("VkPhysicalDeviceProperties2", sType=self.vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2)
            chain = [p.subgroup, p.maint3]
            chain += [p.pushp] if "VK_KHR_push_descriptor" in exts else []
            chain += [p.maint4] if v13 else []
            chain += [p.driver] if p.have_driver else []
            chain += [p.sgsize] if p.have_sgsize else []
            self._chain(props2, *chain)
            self.lib.vkGetPhysicalDeviceProperties2(pd, props2)
        return p

    def _features2(self, pd, exts: set, v11: bool, v12: bool, v13: bool) -> SimpleNamespace:
        """The feature structs ``describe`` reads: f2 (core features), s16, s8, f16, coop_khr, coop_nv,
        vmm, sgsize_f; one vkGetPhysicalDeviceFeatures2 where Vulkan 1.1 is there (each struct chained
        only where its version or extension is), else the 1.0 call for the core features alone."""
        f = self._structs(
            f2=("VkPhysicalDeviceFeatures2", "PHYSICAL_DEVICE_FEATURES_2"),
            s16=("VkPhysicalDevice16BitStorageFeatures", "PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES"),
            s8=("VkPhysicalDevice8BitStorageFeatures", "PHYSICAL_DEVICE_8BIT_STORAGE_FEATURES"),
            f16=("VkPhysicalDeviceShaderFloat16Int8Features", "PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES"),
            coop_khr=("VkPhysicalDeviceCooperativeMatrixFeaturesKHR", "PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR"),
            coop_nv=("VkPhysicalDeviceCooperativeMatrixFeaturesNV", "PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_NV"),
            vmm=("VkPhysicalDeviceVulkanMemoryModelFeatures", "PHYSICAL_DEVICE_VULKAN_MEMORY_MODEL_FEATURES"),
            sgsize_f=("VkPhysicalDeviceSubgroupSizeControlFeatures", "PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_FEATURES"))
        if v11:
            chain = [f.s16]
            chain += [f.s8] if v12 or "VK_KHR_8bit_storage" in exts else []
            chain += [f.f16] if v12 or "VK_KHR_shader_float16_int8" in exts else []
            chain += [f.coop_khr] if "VK_KHR_cooperative_matrix" in exts else []
            chain += [f.coop_nv] if "VK_NV_cooperative_matrix" in exts else []
            chain += [f.vmm] if v12 else []
            chain += [f.sgsize_f] if v13 else []
            self._chain(f.f2, *chain)
            self.lib.vkGetPhysicalDeviceFeatures2(pd, f.f2)
        else:
            self.lib.vkGetPhysicalDeviceFeatures(pd, self.ffi.addressof(f.f2.features))
        return f

    def _queue_family(self, pd) -> tuple[int | None, int, list[dict]]:
        """The addon's choice of compute queue family: compute-only preferred, timestamps break ties."""
        ffi = self.ffi
        n = ffi.new("uint32_t *")
        self.lib.vkGetPhysicalDeviceQueueFamilyProperties(pd, n, ffi.NULL)
        fams = ffi.new("VkQueueFamilyProperties[]", n[0])
        self.lib.vkGetPhysicalDeviceQueueFamilyProperties(pd, n, fams)
        best, best_score, out = None, -1, []
        for i in range(n[0]):
            f = fams[i]
            out.append({"index": i, "count": int(f.queueCount), "compute": bool(f.queueFlags & _QUEUE_COMPUTE),
                        "graphics": bool(f.queueFlags & _QUEUE_GRAPHICS), "timestamp_valid_bits": int(f.timestampValidBits)})
            if not (f.queueFlags & _QUEUE_COMPUTE) or f.queueCount == 0:
                continue
            score = (2 if f.timestampValidBits else 0) + (0 if f.queueFlags & _QUEUE_GRAPHICS else 1)
            if score > best_score:
                best, best_score = i, score
        return best, (out[best]["timestamp_valid_bits"] if best is not None else 0), out

    def _coop_list(self, pd) -> list[dict]:
        """Each cooperative-matrix shape the device offers (VK_KHR_cooperative_matrix), as the addon lists it:
        {"m", "n", "k", "a", "b", "c", "result", "scope", "saturating"}."""
        get = self._proc("vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", "PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
        if get is None:
            return []
        ffi = self.ffi
        n = ffi.new("uint32_t *")
        get(pd, n, ffi.NULL)
        arr = ffi.new("VkCooperativeMatrixPropertiesKHR[]", n[0])
        for i in range(n[0]):
            arr[i].sType = self.vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
        get(pd, n, arr)
        return [{"m": int(p.MSize), "n": int(p.NSize), "k": int(p.KSize), "a": _component(p.AType), "b": _component(p.BType),
                 "c": _component(p.CType), "result": _component(p.ResultType), "scope": _SCOPES.get(int(p.scope), str(int(p.scope))),
                 "saturating": bool(p.saturatingAccumulation)} for p in (arr[i] for i in range(n[0]))]


# VkComponentTypeKHR and VkScopeKHR values by the addon's short names (helios/native/module.cpp).
_COMPONENTS = {0: "f16", 1: "f32", 2: "f64", 3: "i8", 4: "i16", 5: "i32", 6: "i64", 7: "u8", 8: "u16", 9: "u32", 10: "u64",
               1000141000: "bf16", 1000491000: "i8_packed", 1000491001: "u8_packed", 1000491002: "e4m3", 1000491003: "e5m2"}
_SCOPES = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queue_family"}


_EXTENSIONS_OF_INTEREST = frozenset({
    "VK_KHR_push_descriptor", "VK_EXT_calibrated_timestamps", "VK_KHR_cooperative_matrix", "VK_NV_cooperative_matrix",
    "VK_KHR_shader_bfloat16", "VK_EXT_subgroup_size_control", "VK_KHR_shader_float16_int8", "VK_KHR_16bit_storage",
    "VK_KHR_8bit_storage", "VK_EXT_memory_budget"})


def _limits(L, props: SimpleNamespace, feats: SimpleNamespace, ts_bits: int, v11: bool, v13: bool) -> dict:
    """The addon's ``limits`` of a device, by the addon's rules."""
    # A pipeline may require a subgroup size on Vulkan 1.3 with the subgroupSizeControl feature
    # and compute among requiredSubgroupSizeStages, else 0..0.
    sg = props.sgsize
    sg_control = (v13 and bool(feats.sgsize_f.subgroupSizeControl) and bool(sg.requiredSubgroupSizeStages & _STAGE_COMPUTE)
                  and 0 < int(sg.minSubgroupSize) <= int(sg.maxSubgroupSize))
    return {
        "max_storage_buffer_range": int(L.maxStorageBufferRange),
        "max_shared_memory": int(L.maxComputeSharedMemorySize),
        "max_workgroup_invocations": int(L.maxComputeWorkGroupInvocations),
        "max_workgroup_size": [int(L.maxComputeWorkGroupSize[i]) for i in range(3)],
        "max_workgroup_count": [int(L.maxComputeWorkGroupCount[i]) for i in range(3)],
        "max_push_constants": int(L.maxPushConstantsSize),
        "min_storage_buffer_offset_alignment": int(L.minStorageBufferOffsetAlignment),
        "timestamp_period": float(L.timestampPeriod),
        "timestamp_valid_bits": int(ts_bits),
        "subgroup_size": int(props.subgroup.subgroupSize) if v11 else 0,
        "min_subgroup_size": int(sg.minSubgroupSize) if sg_control else 0,
        "max_subgroup_size": int(sg.maxSubgroupSize) if sg_control else 0,
        # Before 1.1 there is no portable limit; the addon assumes the spec's 1 GiB.
        "max_memory_allocation_size": int(props.maint3.maxMemoryAllocationSize) if v11 else 1 << 30,
    }


def _cooperative_extra(exts: set, feats: SimpleNamespace, coop_list: list[dict]) -> dict:
    """The doctor's own cooperative-matrix fields: each extension's feature and the shapes offered."""
    return {
        "cooperative_matrix_khr": bool("VK_KHR_cooperative_matrix" in exts and feats.coop_khr.cooperativeMatrix),
        "cooperative_matrix_nv": bool("VK_NV_cooperative_matrix" in exts and feats.coop_nv.cooperativeMatrix),
        "cooperative_matrix_shapes": [_coop_label(c) for c in coop_list],
    }


def _component(t) -> str:
    return _COMPONENTS.get(int(t), str(int(t)))


def _coop_label(c: dict) -> str:
    """"MxNxK A*B+C" of one shape."""
    return f"{c['m']}x{c['n']}x{c['k']} {c['a']}*{c['b']}+{c['c']}"


def read_devices(vk=None) -> dict:
    """What the bindings see: ``{"loader_version", "loader_library", "instance_api", "devices": [...]}``.

    ``devices`` holds the addon's dict of each device with a compute queue, in the addon's
    order (discrete > integrated > virtual > cpu > other, the driver's order within a type)
    with the same ``index``; each also has an ``extra`` dict of what the addon does not report.
    Raises ImportError/OSError when the bindings or the loader are missing, RuntimeError when
    Vulkan itself fails."""
    vk = vk or load()
    r = _Reader(vk)
    try:
        found = [d for d in (r.describe(pd) for pd in r.physical_devices()) if d is not None]
    finally:
        r.close()
    found.sort(key=lambda d: d["_rank"])  # stable: a type keeps the driver's order, as in the addon
    for i, d in enumerate(found):
        d.pop("_rank")
        d["index"] = i
    return {"loader_version": version_string(r.loader_version), "loader_library": loader_library(),
            "instance_api": version_string(r.instance_api), "devices": found}
