// pybind11 bindings of helios._vulkan.
//
// The hot calls (dispatch above all) take raw py::handle arguments and parse
// them with the CPython API: pybind11's generic list/tuple casters allocate
// std::vectors and are several times slower, and the dispatch-overhead budget
// is a few hundred nanoseconds of host time per op.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unordered_map>
#include <unordered_set>

#include "device.h"
#include "instance.h"
#include "vk_util.h"

namespace py = pybind11;
using namespace helios_vk;

namespace {

// Devices alive in this process, closed at interpreter exit (before the
// driver's own teardown can run) so destruction order is always safe.
std::unordered_set<Device*>& live_devices() {
  static auto* s = new std::unordered_set<Device*>();
  return *s;
}

// The Python object behind a Device: the C++ device plus the interning cache
// from Python string objects to name ids (a pointer lookup per dispatch).
struct PyDevice {
  std::unique_ptr<Device> dev;
  std::unordered_map<PyObject*, uint32_t> name_cache;  // holds a reference to each key

  ~PyDevice() {
    live_devices().erase(dev.get());
    clear_name_cache();
  }
  void clear_name_cache() {
    // Reference drops are only safe while the interpreter is alive.
    if (Py_IsInitialized())
      for (auto& kv : name_cache) Py_DECREF(kv.first);
    name_cache.clear();
  }
  Device& d() {
    if (!dev || dev->closed()) throw std::runtime_error("this Device is closed; create a new helios._vulkan.Device");
    return *dev;
  }
  uint32_t name_id(PyObject* name) {
    if (name == Py_None) return 0;
    auto it = name_cache.find(name);
    if (it != name_cache.end()) return it->second;
    if (!PyUnicode_Check(name)) throw py::type_error("name must be a str");
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(name, &n);
    if (!s) throw py::error_already_set();
    uint32_t id = d().intern(std::string(s, size_t(n)));
    // Names built on the fly (f-strings) would grow the cache without bound.
    if (name_cache.size() >= 4096) clear_name_cache();
    Py_INCREF(name);
    name_cache.emplace(name, id);
    return id;
  }
};

std::string hex(const uint8_t* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += digits[p[i] >> 4], s += digits[p[i] & 15];
  return s;
}

// Short names of VkComponentTypeKHR values (and the bfloat16 / fp8 ones of later extensions).
std::string component_name(int32_t t) {
  static const char* base[] = {"f16", "f32", "f64", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64"};
  if (t >= 0 && t <= 10) return base[t];
  switch (t) {
    case 1000141000: return "bf16";
    case 1000491000: return "i8_packed";
    case 1000491001: return "u8_packed";
    case 1000491002: return "e4m3";
    case 1000491003: return "e5m2";
    default: return std::to_string(t);
  }
}

std::string scope_name(int32_t s) {
  switch (s) {
    case 1: return "device";
    case 2: return "workgroup";
    case 3: return "subgroup";
    case 5: return "queue_family";
    default: return std::to_string(s);
  }
}

py::list coopmat_list(const PhysicalDeviceInfo& d) {
  py::list out;
  for (const auto& c : d.coopmat) {
    py::dict x;
    x["m"] = c.m;
    x["n"] = c.n;
    x["k"] = c.k;
    x["a"] = component_name(c.a);
    x["b"] = component_name(c.b);
    x["c"] = component_name(c.c);
    x["result"] = component_name(c.result);
    x["scope"] = scope_name(c.scope);
    x["saturating"] = c.saturating;
    out.append(x);
  }
  return out;
}

py::dict info_dict(const PhysicalDeviceInfo& d) {
  py::dict limits;
  limits["max_storage_buffer_range"] = d.max_storage_buffer_range;
  limits["max_shared_memory"] = d.max_shared_memory;
  limits["max_workgroup_invocations"] = d.max_workgroup_invocations;
  limits["max_workgroup_size"] = py::make_tuple(d.max_workgroup_size[0], d.max_workgroup_size[1], d.max_workgroup_size[2]);
  limits["max_workgroup_count"] =
      py::make_tuple(d.max_workgroup_count[0], d.max_workgroup_count[1], d.max_workgroup_count[2]);
  limits["max_push_constants"] = d.max_push_constants;
  limits["min_storage_buffer_offset_alignment"] = d.min_storage_buffer_offset_alignment;
  limits["timestamp_period"] = d.timestamp_period;
  limits["timestamp_valid_bits"] = d.timestamp_valid_bits;
  limits["subgroup_size"] = d.subgroup_size;
  limits["min_subgroup_size"] = d.min_subgroup_size;  // 0: no pipeline may require a subgroup size
  limits["max_subgroup_size"] = d.max_subgroup_size;
  limits["max_memory_allocation_size"] = d.max_memory_allocation_size;
  py::dict features;
  features["float16"] = d.float16;
  features["storage16"] = d.storage16;
  features["storage8"] = d.storage8;
  features["int64"] = d.int64;
  features["int16"] = d.int16;
  features["push_descriptor"] = d.push_descriptor;
  features["calibrated_timestamps"] = d.calibrated_timestamps;
  features["unified_memory"] = d.unified_memory;
  py::dict out;
  out["index"] = d.index;
  out["name"] = d.name;
  out["type"] = d.type;
  out["vendor_id"] = d.vendor_id;
  out["device_id"] = d.device_id;
  out["driver_version"] = d.driver_version;
  out["api_version"] = version_string(d.api_version);
  out["pipeline_cache_uuid"] = hex(d.pipeline_cache_uuid.data(), d.pipeline_cache_uuid.size());
  out["limits"] = limits;
  out["features"] = features;
  out["device_local_bytes"] = d.device_local_bytes;
  out["cooperative_matrix"] = coopmat_list(d);  // [] where the device cannot run the coopmat kernels
  return out;
}

int pool_arg(const std::string& name) {
  int p = pool_from_name(name.data(), name.size());
  if (p < 0) throw ArgError("pool must be 'weights', 'activations' or 'staging', got '" + name + "'");
  return p;
}

// A non-negative Python int as uint64 (ValueError naming the argument otherwise).
inline uint64_t as_u64(PyObject* o, const char* what, const char* op) {
  if (!PyLong_Check(o)) {
    // numpy integers and other __index__ types: rarer, so off the fast path.
    PyObject* idx = PyNumber_Index(o);
    if (!idx) {
      PyErr_Clear();
      throw py::type_error(strf("%s: %s must be an int, got %s", op, what, Py_TYPE(o)->tp_name));
    }
    uint64_t v;
    try {
      v = as_u64(idx, what, op);
    } catch (...) {
      Py_DECREF(idx);
      throw;
    }
    Py_DECREF(idx);
    return v;
  }
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw ArgError(strf("%s: %s must be a non-negative int below 2**64", op, what));
  }
  return v;
}

// Read-only bytes of bytes/bytearray/memoryview/numpy; `view` is released by the caller.
struct Bytes {
  Py_buffer view{};
  bool held = false;
  const char* data = nullptr;
  Py_ssize_t size = 0;
  Bytes(PyObject* o, int flags, const char* op, const char* what) {
    if (o == Py_None) return;
    if (PyBytes_CheckExact(o) && !(flags & PyBUF_WRITABLE)) {
      data = PyBytes_AS_STRING(o);
      size = PyBytes_GET_SIZE(o);
      return;
    }
    if (PyObject_GetBuffer(o, &view, flags | PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      throw ArgError(strf("%s: %s must be a C-contiguous%s buffer (bytes, bytearray, numpy array)", op, what,
                          (flags & PyBUF_WRITABLE) ? " writable" : ""));
    }
    held = true;
    data = static_cast<const char*>(view.buf);
    size = view.len;
  }
  ~Bytes() {
    if (held) PyBuffer_Release(&view);
  }
};

void parse_groups(PyObject* g, uint32_t out[3], const char* op) {
  PyObject* seq = PySequence_Fast(g, "groups must be a 3-tuple of ints");
  if (!seq) {
    PyErr_Clear();
    throw py::type_error(strf("%s: groups must be a 3-tuple of ints", op));
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n != 3) {
    Py_DECREF(seq);
    throw ArgError(strf("%s: groups must have 3 entries, got %zd", op, n));
  }
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (int i = 0; i < 3; ++i) {
    uint64_t v;
    try {
      v = as_u64(items[i], "groups", op);
    } catch (...) {
      Py_DECREF(seq);
      throw;
    }
    if (v > 0xffffffffull) {
      Py_DECREF(seq);
      throw ArgError(strf("%s: groups[%d] = %llu does not fit in 32 bits", op, i, (unsigned long long)v));
    }
    out[i] = uint32_t(v);
  }
  Py_DECREF(seq);
}

// buffers: a list/tuple of (handle, offset, nbytes, writes) tuples.
size_t parse_buffers(PyObject* bufs, BufArg* out, size_t cap, const char* op) {
  PyObject* seq = PySequence_Fast(bufs, "buffers must be a list of tuples");
  if (!seq) {
    PyErr_Clear();
    throw py::type_error(strf("%s: buffers must be a list of (handle, offset, nbytes, writes) tuples", op));
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  try {
    if (size_t(n) > cap) throw ArgError(strf("%s: %zd buffers, at most %zu are supported", op, n, cap));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* t = items[i];
      PyObject* f[4];
      if (PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 4) {
        for (int k = 0; k < 4; ++k) f[k] = PyTuple_GET_ITEM(t, k);
      } else if (PyList_Check(t) && PyList_GET_SIZE(t) == 4) {
        for (int k = 0; k < 4; ++k) f[k] = PyList_GET_ITEM(t, k);
      } else {
        throw ArgError(strf("%s: buffers[%zd] must be a (handle, offset, nbytes, writes) tuple", op, i));
      }
      out[i].handle = as_u64(f[0], "buffer handle", op);
      out[i].offset = as_u64(f[1], "buffer offset", op);
      out[i].nbytes = as_u64(f[2], "buffer nbytes", op);
      int w = PyObject_IsTrue(f[3]);
      if (w < 0) throw py::error_already_set();
      out[i].write = w != 0;
    }
  } catch (...) {
    Py_DECREF(seq);
    throw;
  }
  Py_DECREF(seq);
  return size_t(n);
}

// "dispatch 'name'" for messages raised while parsing.
std::string op_label(PyObject* name) {
  if (name && PyUnicode_Check(name)) {
    const char* s = PyUnicode_AsUTF8(name);
    if (s) return std::string("dispatch '") + s + "'";
    PyErr_Clear();
  }
  return "dispatch";
}

void shutdown() {
  // atexit: close every live device while the driver is certainly loaded,
  // then drop the module's instance reference.
  std::vector<Device*> devs(live_devices().begin(), live_devices().end());
  for (Device* d : devs) {
    try {
      d->close();
    } catch (...) {
    }
  }
  release_instance();
}

}  // namespace

PYBIND11_MODULE(_vulkan, m) {
  m.doc() = "Helios Vulkan backend: devices, pooled memory, pipelines and a deferred command stream.";

  // register_exception keeps the type alive safely past interpreter teardown.
  py::register_exception<OutOfMemory>(m, "OutOfMemoryError", PyExc_MemoryError);
  m.attr("OutOfMemoryError").attr("__doc__") =
      "Device memory exhausted or a request above a device limit; says bytes asked and pool state.";

  m.def(
      "enumerate_devices",
      []() {
        py::list out;
        auto inst = get_instance();
        if (!inst) return out;
        for (const auto& d : inst->devices) out.append(info_dict(d));
        return out;
      },
      "Every Vulkan physical device, discrete GPUs first, then integrated, virtual, CPU, other.");
  m.def("last_error", []() { return last_error(); }, "Why enumerate_devices() returned [] ('' if it did not).");
  m.def("_shutdown", &shutdown, "Close every Device and release the instance (registered with atexit).");

  py::class_<PyDevice>(m, "Device", "A Vulkan logical device with one compute queue, pooled memory and a command stream.")
      .def(py::init([](int index, const std::string& cache_dir) {
             auto p = std::make_unique<PyDevice>();
             p->dev = std::make_unique<Device>(index, cache_dir);
             live_devices().insert(p->dev.get());
             return p;
           }),
           py::arg("index") = 0, py::arg("pipeline_cache_dir") = "",
           "Open device `index` of enumerate_devices(); the pipeline cache lives in pipeline_cache_dir ('' = none).")
      .def_property_readonly(
          "info", [](PyDevice& s) { return info_dict(s.d().info()); }, "The enumerate_devices() dict of this device.")
      .def_property_readonly("closed", [](PyDevice& s) { return !s.dev || s.dev->closed(); }, "True after close().")
      .def_property_readonly(
          "timeline_semaphore", [](PyDevice& s) { return s.d().info().timeline_semaphore; },
          "Whether the stream tracks completion with a timeline semaphore (else a fence per command buffer).")
      .def_property_readonly(
          "block_size", [](PyDevice& s) { return s.d().block_size(); }, "Bytes per sub-allocated pool block.")
      .def_property_readonly(
          "pipeline_cache_path", [](PyDevice& s) { return s.d().pipeline_cache_path(); },
          "File the VkPipelineCache is saved to ('' without a cache dir).")
      .def_property_readonly(
          "pipeline_cache_loaded", [](PyDevice& s) { return s.d().pipeline_cache_loaded(); },
          "True if a matching pipeline cache file was loaded at creation.")
      .def_property(
          "auto_submit_dispatches", [](PyDevice& s) { return s.d().auto_submit(); },
          [](PyDevice& s, int64_t n) {
            if (n < 1 || n > 1000000) throw ArgError("auto_submit_dispatches must be in 1..1000000");
            s.d().set_auto_submit(uint32_t(n));
          },
          "Recorded ops after which the open command buffer is submitted (default 256).")
      // ---- memory
      .def(
          "alloc", [](PyDevice& s, int64_t nbytes, const std::string& pool) {
            if (nbytes < 0) throw ArgError(strf("alloc: nbytes must be >= 0, got %lld", (long long)nbytes));
            return s.d().alloc(uint64_t(nbytes), pool_arg(pool));
          },
          py::arg("nbytes"), py::arg("pool") = "activations",
          "Allocate nbytes in pool 'weights' | 'activations' | 'staging'; returns a handle. OutOfMemoryError when full.")
      .def("free", [](PyDevice& s, uint64_t h) { s.d().free(h); }, py::arg("handle"),
           "Free a handle; its range is reused only after all work recorded so far completes.")
      .def("size_of", [](PyDevice& s, uint64_t h) { return s.d().size_of(h); }, py::arg("handle"),
           "Requested size in bytes of an allocation.")
      .def(
          "location",
          [](PyDevice& s, uint64_t h) {
            uint32_t block;
            uint64_t off;
            s.d().location(h, block, off);
            return py::make_tuple(block, off);
          },
          py::arg("handle"), "(block id, byte offset in the block's VkBuffer) of an allocation.")
      .def("pool_stats",
           [](PyDevice& s) {
             // "blocks" counts every VkDeviceMemory of the pool (dedicated ones too).
             Device& d = s.d();
             py::dict out;
             for (int p = 0; p < kNumPools; ++p) {
               const PoolStats& st = d.pool_stats(p);
               py::dict e;
               e["blocks"] = st.blocks + st.dedicated;
               e["dedicated"] = st.dedicated;
               e["reserved_bytes"] = st.reserved_bytes;
               e["in_use_bytes"] = st.in_use_bytes;
               e["peak_in_use_bytes"] = st.peak_in_use_bytes;
               e["pending_free_bytes"] = st.pending_free_bytes;
               e["allocs"] = st.allocs;
               e["frees"] = st.frees;
               out[pool_name(p)] = e;
             }
             return out;
           },
           "Per pool: blocks, dedicated, reserved_bytes, in_use_bytes, peak_in_use_bytes, pending_free_bytes, allocs, "
           "frees.")
      // ---- host transfers
      .def(
          "write",
          [](PyDevice& s, uint64_t h, int64_t offset, py::handle data) {
            if (offset < 0) throw ArgError("write: offset must be >= 0");
            Bytes b(data.ptr(), PyBUF_SIMPLE, "write", "data");
            s.d().write(h, uint64_t(offset), b.data, uint64_t(b.size));
          },
          py::arg("handle"), py::arg("offset"), py::arg("data"),
          "Copy len(data) bytes into the allocation at offset; waits only for unfinished work on that range.")
      .def(
          "read",
          [](PyDevice& s, uint64_t h, int64_t offset, py::handle out) {
            if (offset < 0) throw ArgError("read: offset must be >= 0");
            Bytes b(out.ptr(), PyBUF_WRITABLE, "read", "out");
            s.d().read(h, uint64_t(offset), const_cast<char*>(b.data), uint64_t(b.size));
          },
          py::arg("handle"), py::arg("offset"), py::arg("out"),
          "Fill the writable buffer out from the allocation at offset; submits and waits only for pending writes.")
      .def(
          "map",
          [](PyDevice& s, uint64_t h, int64_t offset, int64_t n, bool for_write) -> py::object {
            if (offset < 0 || n < 0) throw ArgError("map: offset and nbytes must be >= 0");
            uint8_t* p = s.d().map(h, uint64_t(offset), uint64_t(n), for_write);
            if (!p) return py::none();
            return py::memoryview::from_memory(p, py::ssize_t(n), !for_write);
          },
          py::arg("handle"), py::arg("offset"), py::arg("nbytes"), py::arg("for_write") = false,
          "A memoryview of the allocation's bytes [offset, offset+nbytes) in host-visible memory, after waiting for "
          "recorded work that writes them (for_write: that touches them); None where the memory is not mapped. Valid "
          "while the allocation lives; call host_wrote() after writing through it.")
      .def(
          "ready",
          [](PyDevice& s, uint64_t h, int64_t offset, int64_t n, bool for_write) {
            if (offset < 0 || n < 0) throw ArgError("ready: offset and nbytes must be >= 0");
            return s.d().ready(h, uint64_t(offset), uint64_t(n), for_write);
          },
          py::arg("handle"), py::arg("offset"), py::arg("nbytes"), py::arg("for_write") = false,
          "True when no unfinished work writes the range (for_write: touches it); never waits, submits the recorded "
          "work that does so polling makes progress.")
      .def(
          "host_wrote",
          [](PyDevice& s, uint64_t h, int64_t offset, int64_t n) {
            if (offset < 0 || n < 0) throw ArgError("host_wrote: offset and nbytes must be >= 0");
            s.d().host_wrote(h, uint64_t(offset), uint64_t(n));
          },
          py::arg("handle"), py::arg("offset"), py::arg("nbytes"),
          "Make host writes made through map() visible to the device (flushes non-coherent memory).")
      .def(
          "copy",
          [](PyDevice& s, uint64_t src, int64_t so, uint64_t dst, int64_t dof, int64_t n) {
            if (so < 0 || dof < 0 || n < 0) throw ArgError("copy: offsets and nbytes must be >= 0");
            s.d().copy(src, uint64_t(so), dst, uint64_t(dof), uint64_t(n));
          },
          py::arg("src"), py::arg("src_offset"), py::arg("dst"), py::arg("dst_offset"), py::arg("nbytes"),
          "Record a buffer-to-buffer copy (hazard-tracked; returns at once).")
      .def(
          "fill",
          [](PyDevice& s, uint64_t h, int64_t off, int64_t n, int64_t value) {
            if (off < 0 || n < 0) throw ArgError("fill: offset and nbytes must be >= 0");
            if (value < -(1ll << 31) || value >= (1ll << 32)) throw ArgError("fill: value must fit in 32 bits");
            s.d().fill(h, uint64_t(off), uint64_t(n), uint32_t(value));
          },
          py::arg("handle"), py::arg("offset"), py::arg("nbytes"), py::arg("value"),
          "Record a fill of nbytes at offset with the 32-bit value (both multiples of 4).")
      // ---- pipelines
      .def(
          "pipeline",
          [](PyDevice& s, py::handle spirv, int64_t num_buffers, int64_t push_size, py::handle spec, const std::string& name,
             int64_t subgroup_size) {
            if (num_buffers < 0 || push_size < 0) throw ArgError("pipeline: num_buffers and push_size must be >= 0");
            if (subgroup_size < 0 || subgroup_size > 65536)
              throw ArgError(strf("pipeline '%s': subgroup_size must be 0 (the driver's choice) or a subgroup size, got %lld",
                                  name.c_str(), (long long)subgroup_size));
            Bytes code(spirv.ptr(), PyBUF_SIMPLE, "pipeline", "spirv");
            std::vector<uint32_t> sc;
            if (!spec.is_none()) {
              for (auto item : py::reinterpret_borrow<py::sequence>(spec)) {
                long long v = item.cast<long long>();
                if (v < -(1ll << 31) || v >= (1ll << 32))
                  throw ArgError(strf("pipeline '%s': specialization constant %zu = %lld does not fit in 32 bits",
                                      name.c_str(), sc.size(), v));
                sc.push_back(uint32_t(v));
              }
            }
            return s.d().pipeline(reinterpret_cast<const uint8_t*>(code.data), size_t(code.size), uint32_t(num_buffers),
                                  uint32_t(push_size), sc, name, uint32_t(subgroup_size));
          },
          py::arg("spirv"), py::arg("num_buffers"), py::arg("push_size"), py::arg("spec") = py::list(),
          py::arg("name") = "", py::arg("subgroup_size") = 0,
          "Pipeline id for SPIR-V with num_buffers storage buffers, push_size bytes of push constants and "
          "specialization constants spec[i] (constant_id i); cached.  subgroup_size > 0: it runs in full "
          "subgroups of exactly that size (limits min_subgroup_size..max_subgroup_size; ValueError elsewhere).")
      .def("save_pipeline_cache", [](PyDevice& s) { s.d().save_pipeline_cache(); },
           "Write the pipeline cache file (temp file, fsync, rename).")
      // ---- dispatch (hot path)
      .def(
          "dispatch",
          [](PyDevice& s, py::handle pipeline, py::handle buffers, py::handle push, py::handle groups, py::handle name,
             py::handle flops, py::handle nbytes) {
            Device& d = s.d();
            uint32_t name_id = s.name_id(name.ptr());
            const char* op = "dispatch";
            std::string label;
            BufArg bufs[Pipelines::kMaxBuffers];
            size_t nb;
            uint32_t g[3];
            uint64_t pid, fl, by;
            try {
              pid = as_u64(pipeline.ptr(), "pipeline", op);
              nb = parse_buffers(buffers.ptr(), bufs, Pipelines::kMaxBuffers, op);
              parse_groups(groups.ptr(), g, op);
              fl = as_u64(flops.ptr(), "flops", op);
              by = as_u64(nbytes.ptr(), "nbytes", op);
            } catch (const ArgError& e) {
              // Re-raise with the op name (kept off the fast path).
              label = op_label(name.ptr());
              throw ArgError(label + std::string(e.what()).substr(8));
            }
            PyObject* po = push.ptr();
            if (PyBytes_CheckExact(po)) {  // the common case: struct.pack output, no buffer protocol
              d.dispatch(pid, bufs, nb, PyBytes_AS_STRING(po), size_t(PyBytes_GET_SIZE(po)), g, name_id, fl, by);
              return;
            }
            Bytes pc(po, PyBUF_SIMPLE, op_label(name.ptr()).c_str(), "push");
            d.dispatch(pid, bufs, nb, pc.data, size_t(pc.size), g, name_id, fl, by);
          },
          py::arg("pipeline"), py::arg("buffers"), py::arg("push"), py::arg("groups"), py::arg("name") = "",
          py::arg("flops") = 0, py::arg("nbytes") = 0,
          "Record a dispatch; buffers are (handle, offset, nbytes, writes) for bindings 0..n-1. Returns at once.")
      .def(
          "bench_raw_dispatch",
          [](PyDevice& s, uint64_t pipeline, py::handle buffers, py::bytes push, py::handle groups, int64_t n) {
            if (n < 0) throw ArgError("bench_raw_dispatch: n must be >= 0");
            BufArg bufs[Pipelines::kMaxBuffers];
            size_t nb = parse_buffers(buffers.ptr(), bufs, Pipelines::kMaxBuffers, "bench_raw_dispatch");
            uint32_t g[3];
            parse_groups(groups.ptr(), g, "bench_raw_dispatch");
            std::vector<BufArg> v(bufs, bufs + nb);
            return s.d().bench_raw_dispatch(pipeline, v, std::string(push), g, uint64_t(n));
          },
          py::arg("pipeline"), py::arg("buffers"), py::arg("push"), py::arg("groups"), py::arg("n"),
          "Records n identical dispatches in C++ through the same stream path, synchronizes, returns wall seconds.")
      // ---- stream
      .def("flush", [](PyDevice& s) { s.d().flush(); }, "Submit what is recorded; do not wait.")
      .def("synchronize", [](PyDevice& s) { s.d().synchronize(); }, "Submit and wait for all work; reclaim frees.")
      .def("stats",
           [](PyDevice& s) {
             Device& d = s.d();
             StreamStats st = d.stats();
             py::dict out;
             out["submits"] = st.submits;
             out["dispatches"] = st.dispatches;
             out["barriers"] = st.barriers;
             out["fence_waits"] = st.fence_waits;
             out["copies"] = st.copies;
             out["pending_dispatches"] = d.pending_ops();
             return out;
           },
           "Counters: submits, dispatches, barriers, fence_waits, copies, pending_dispatches (recorded ops not yet "
           "submitted).")
      .def("reset_stats", [](PyDevice& s) { s.d().reset_stats(); }, "Zero the stats() counters.")
      // ---- profiling
      .def("set_profiling", [](PyDevice& s, bool on) { s.d().set_profiling(on); }, py::arg("on"),
           "Bracket every dispatch/copy/fill with device timestamps while on.")
      .def_property_readonly("profiling", [](PyDevice& s) { return s.d().profiling(); }, "Whether profiling is on.")
      .def("take_events",
           [](PyDevice& s) {
             Device& d = s.d();
             std::vector<Event> evs;
             std::vector<SubmitRecord> subs;
             d.take_events(evs, subs);
             py::list el, sl;
             std::unordered_map<uint32_t, py::str> cache;
             for (const Event& e : evs) {
               auto it = cache.find(e.name_id);
               if (it == cache.end()) it = cache.emplace(e.name_id, py::str(d.name_of(e.name_id))).first;
               py::dict x;
               x["name"] = it->second;
               x["flops"] = e.flops;
               x["bytes"] = e.bytes;
               x["start_ns"] = e.start_ns;
               x["end_ns"] = e.end_ns;
               x["submit"] = e.submit;
               x["host_record_ns"] = e.host_record_ns;
               el.append(x);
             }
             for (const SubmitRecord& r : subs) {
               py::dict x;
               x["submit"] = r.submit;
               x["host_submit_ns"] = r.host_submit_ns;
               x["host_done_ns"] = r.host_done_ns;
               x["dispatches"] = r.dispatches;
               sl.append(x);
             }
             py::dict out;
             out["events"] = el;
             out["submits"] = sl;
             return out;
           },
           "Completed timed ops and submissions since the last take (never waits).")
      // ---- marks: phase timing without waiting
      .def_property_readonly("marks_supported", [](PyDevice& s) { return s.d().marks_supported(); },
                             "Whether mark() works: the compute queue writes timestamps.")
      .def("mark", [](PyDevice& s) { return s.d().mark(); },
           "Record a device timestamp at this point of the stream (after everything recorded before it); "
           "returns its id. Profiling need not be on.")
      .def("wait_mark", [](PyDevice& s, uint64_t id) { s.d().wait_mark(id); }, py::arg("id"),
           "Submit if needed and wait until the work recorded before mark `id` has finished.")
      .def("take_marks",
           [](PyDevice& s) {
             std::vector<Mark> ms = s.d().take_marks();
             py::dict out;
             for (const Mark& m : ms) out[py::int_(m.id)] = py::int_(m.device_ns);
             return out;
           },
           "{id: device ns} of the marks whose work has finished since the last take (never waits; ns on "
           "the device's timestamp clock: only differences mean anything).")
      .def("close", [](PyDevice& s) {
        if (!s.dev) return;
        live_devices().erase(s.dev.get());
        s.clear_name_cache();
        s.dev->close();
      }, "Wait idle, save the pipeline cache, destroy everything; the Device is unusable afterwards.")
      .def("__enter__", [](py::object self) { return self; }, "Context manager: close() on exit.")
      .def("__exit__", [](PyDevice& s, py::args) {
        if (!s.dev) return;
        live_devices().erase(s.dev.get());
        s.clear_name_cache();
        s.dev->close();
      }, "Close the device.");

  // Close devices before interpreter teardown (module globals die in arbitrary order).
  py::module_::import("atexit").attr("register")(m.attr("_shutdown"));
}
