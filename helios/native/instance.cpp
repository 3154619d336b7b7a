// Instance creation and physical-device discovery.
//
// The loader is linked (libvulkan); a missing ICD or a failing driver shows up
// as an error from vkCreateInstance / vkEnumeratePhysicalDevices, which we keep
// in last_error() instead of raising so that enumerate_devices() can return [].
#include "instance.h"

#include <algorithm>
#include <cstring>

#include "vk_util.h"

namespace helios_vk {

namespace {

std::shared_ptr<Instance> g_instance;
std::string g_last_error;

bool has_extension(const std::vector<VkExtensionProperties>& exts, const char* name) {
  for (const auto& e : exts)
    if (std::strcmp(e.extensionName, name) == 0) return true;
  return false;
}

void type_of(VkPhysicalDeviceType t, std::string& name, int& rank) {
  switch (t) {
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: name = "discrete"; rank = 0; return;
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: name = "integrated"; rank = 1; return;
    case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: name = "virtual"; rank = 2; return;
    case VK_PHYSICAL_DEVICE_TYPE_CPU: name = "cpu"; rank = 3; return;
    default: name = "other"; rank = 4; return;
  }
}

// Picks the compute queue family: a compute-only family if there is one (it is
// the asynchronous compute engine on discrete GPUs), else any with COMPUTE.
// Families that can write timestamps win ties.  Returns false if none.
bool pick_queue_family(VkPhysicalDevice pd, uint32_t& family, uint32_t& ts_bits) {
  uint32_t n = 0;
  vkGetPhysicalDeviceQueueFamilyProperties(pd, &n, nullptr);
  std::vector<VkQueueFamilyProperties> fams(n);
  vkGetPhysicalDeviceQueueFamilyProperties(pd, &n, fams.data());
  int best = -1, best_score = -1;
  for (uint32_t i = 0; i < n; ++i) {
    const auto& f = fams[i];
    if (!(f.queueFlags & VK_QUEUE_COMPUTE_BIT) || f.queueCount == 0) continue;
    int score = (f.timestampValidBits ? 2 : 0) + ((f.queueFlags & VK_QUEUE_GRAPHICS_BIT) ? 0 : 1);
    if (score > best_score) best = int(i), best_score = score;
  }
  if (best < 0) return false;
  family = uint32_t(best);
  ts_bits = fams[best].timestampValidBits;
  return true;
}

// The cooperative-matrix shapes of ``pd`` (vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR).
std::vector<CoopMatShape> coopmat_shapes(VkPhysicalDevice pd) {
  using Get = VkResult(VKAPI_PTR*)(VkPhysicalDevice, uint32_t*, CoopMatPropertiesKHR*);
  auto get = reinterpret_cast<Get>(vkGetInstanceProcAddr(g_instance ? g_instance->handle : VK_NULL_HANDLE,
                                                         "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"));
  std::vector<CoopMatShape> out;
  uint32_t n = 0;
  if (!get || get(pd, &n, nullptr) < 0 || n == 0) return out;
  std::vector<CoopMatPropertiesKHR> props(n);
  if (get(pd, &n, props.data()) < 0) return out;
  for (uint32_t i = 0; i < n; ++i) {
    const auto& p = props[i];
    out.push_back({p.MSize, p.NSize, p.KSize, p.AType, p.BType, p.CType, p.ResultType, p.scope,
                   p.saturatingAccumulation == VK_TRUE});
  }
  return out;
}

PhysicalDeviceInfo describe(VkPhysicalDevice pd, uint32_t instance_api) {
  PhysicalDeviceInfo d;
  d.handle = pd;

  VkPhysicalDeviceProperties base{};
  vkGetPhysicalDeviceProperties(pd, &base);
  uint32_t api = std::min(base.apiVersion, instance_api);

  uint32_t next = 0;
  vkEnumerateDeviceExtensionProperties(pd, nullptr, &next, nullptr);
  std::vector<VkExtensionProperties> exts(next);
  vkEnumerateDeviceExtensionProperties(pd, nullptr, &next, exts.data());

  d.push_descriptor = has_extension(exts, VK_KHR_PUSH_DESCRIPTOR_EXTENSION_NAME);
  d.has_ext_16bit_storage = has_extension(exts, VK_KHR_16BIT_STORAGE_EXTENSION_NAME);
  d.has_ext_8bit_storage = has_extension(exts, VK_KHR_8BIT_STORAGE_EXTENSION_NAME);
  d.has_ext_float16_int8 = has_extension(exts, VK_KHR_SHADER_FLOAT16_INT8_EXTENSION_NAME);
  bool has_calibrated = has_extension(exts, VK_EXT_CALIBRATED_TIMESTAMPS_EXTENSION_NAME);

  // Properties: the subgroup size (1.1), push-descriptor and maintenance4 limits.
  VkPhysicalDeviceProperties2 props2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
  VkPhysicalDeviceSubgroupProperties subgroup{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES};
  VkPhysicalDevicePushDescriptorPropertiesKHR pushdesc{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PUSH_DESCRIPTOR_PROPERTIES_KHR};
  VkPhysicalDeviceMaintenance4Properties maint4{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_4_PROPERTIES};
  VkPhysicalDeviceMaintenance3Properties maint3{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES};
  VkPhysicalDeviceSubgroupSizeControlProperties sgctl{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES};
  const bool v11 = api >= VK_API_VERSION_1_1;
  const bool v13 = api >= VK_API_VERSION_1_3;
  if (v11) {
    void** tail = &props2.pNext;
    *tail = &subgroup, tail = &subgroup.pNext;
    *tail = &maint3, tail = &maint3.pNext;
    if (d.push_descriptor) *tail = &pushdesc, tail = &pushdesc.pNext;
    if (v13) *tail = &maint4, tail = &maint4.pNext, *tail = &sgctl, tail = &sgctl.pNext;
    vkGetPhysicalDeviceProperties2(pd, &props2);
  }

  d.name = base.deviceName;
  type_of(base.deviceType, d.type, d.type_rank);
  d.vendor_id = base.vendorID;
  d.device_id = base.deviceID;
  d.driver_version = base.driverVersion;
  d.api_version = base.apiVersion;
  std::memcpy(d.pipeline_cache_uuid.data(), base.pipelineCacheUUID, VK_UUID_SIZE);

  const auto& L = base.limits;
  d.max_storage_buffer_range = L.maxStorageBufferRange;
  d.max_shared_memory = L.maxComputeSharedMemorySize;
  d.max_workgroup_invocations = L.maxComputeWorkGroupInvocations;
  for (int i = 0; i < 3; ++i) {
    d.max_workgroup_size[i] = L.maxComputeWorkGroupSize[i];
    d.max_workgroup_count[i] = L.maxComputeWorkGroupCount[i];
  }
  d.max_push_constants = L.maxPushConstantsSize;
  d.min_storage_buffer_offset_alignment = L.minStorageBufferOffsetAlignment;
  d.min_texel_buffer_offset_alignment = L.minTexelBufferOffsetAlignment;
  d.max_texel_buffer_elements = L.maxTexelBufferElements;
  d.timestamp_period = L.timestampPeriod;
  d.non_coherent_atom_size = L.nonCoherentAtomSize ? L.nonCoherentAtomSize : 1;
  d.subgroup_size = v11 ? subgroup.subgroupSize : 0;
  // Before 1.1 there is no portable limit; 1 GiB is the conservative value the spec guarantees.
  d.max_memory_allocation_size = v11 ? maint3.maxMemoryAllocationSize : (1ull << 30);
  d.max_buffer_size = api >= VK_API_VERSION_1_3 ? maint4.maxBufferSize : 0;
  d.max_push_descriptors = d.push_descriptor && v11 ? pushdesc.maxPushDescriptors : 0;
  if (!v11) d.push_descriptor = false;  // needs properties2 to size it

  // Features.
  VkPhysicalDeviceFeatures2 f2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
  VkPhysicalDevice16BitStorageFeatures s16{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES};
  VkPhysicalDevice8BitStorageFeatures s8{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_8BIT_STORAGE_FEATURES};
  VkPhysicalDeviceShaderFloat16Int8Features f16{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES};
  VkPhysicalDeviceTimelineSemaphoreFeatures timeline{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_TIMELINE_SEMAPHORE_FEATURES};
  VkPhysicalDeviceVulkanMemoryModelFeatures vmm{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_MEMORY_MODEL_FEATURES};
  CoopMatFeaturesKHR coop;
  Bf16FeaturesKHR bf16;
  VkPhysicalDeviceSubgroupSizeControlFeatures sgctl_f{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_FEATURES};
  const bool has_coop = api >= VK_API_VERSION_1_3 && has_extension(exts, kCoopMatExtension);
  const bool has_bf16 = has_coop && has_extension(exts, kBf16Extension);
  if (v11) {
    void** tail = &f2.pNext;
    *tail = &s16, tail = &s16.pNext;  // core in 1.1
    if (api >= VK_API_VERSION_1_2 || d.has_ext_8bit_storage) *tail = &s8, tail = &s8.pNext;
    if (api >= VK_API_VERSION_1_2 || d.has_ext_float16_int8) *tail = &f16, tail = &f16.pNext;
    if (api >= VK_API_VERSION_1_2) *tail = &timeline, tail = &timeline.pNext;  // core in 1.2
    if (has_coop) *tail = &vmm, tail = &vmm.pNext, *tail = &coop, tail = &coop.pNext;
    if (has_bf16) *tail = &bf16, tail = &bf16.pNext;
    if (v13) *tail = &sgctl_f, tail = &sgctl_f.pNext;  // core in 1.3
    vkGetPhysicalDeviceFeatures2(pd, &f2);
  } else {
    vkGetPhysicalDeviceFeatures(pd, &f2.features);
  }
  d.int64 = f2.features.shaderInt64;
  d.int16 = f2.features.shaderInt16;
  d.storage16 = s16.storageBuffer16BitAccess;
  d.storage8 = s8.storageBuffer8BitAccess;
  d.float16 = f16.shaderFloat16;
  d.int8 = f16.shaderInt8;
  d.timeline_semaphore = api >= VK_API_VERSION_1_2 && timeline.timelineSemaphore;
  if (has_coop && coop.cooperativeMatrix && vmm.vulkanMemoryModel) d.coopmat = coopmat_shapes(pd);
  // bf16 shapes only where the kernels can use them (the Device enables both features then)
  auto bf16_shape = [](const CoopMatShape& c) { return c.a == kComponentBf16 || c.b == kComponentBf16; };
  if (!(has_bf16 && bf16.shaderBFloat16Type && bf16.shaderBFloat16CooperativeMatrix))
    d.coopmat.erase(std::remove_if(d.coopmat.begin(), d.coopmat.end(), bf16_shape), d.coopmat.end());
  d.bf16_coopmat = std::any_of(d.coopmat.begin(), d.coopmat.end(), bf16_shape);
  if (v13 && sgctl_f.subgroupSizeControl && (sgctl.requiredSubgroupSizeStages & VK_SHADER_STAGE_COMPUTE_BIT) &&
      sgctl.minSubgroupSize > 0 && sgctl.minSubgroupSize <= sgctl.maxSubgroupSize) {
    d.min_subgroup_size = sgctl.minSubgroupSize;
    d.max_subgroup_size = sgctl.maxSubgroupSize;
    d.compute_full_subgroups = sgctl_f.computeFullSubgroups;
  }

  // Calibrated timestamps count only if both the device and CLOCK_MONOTONIC domains exist.
  if (has_calibrated) {
    auto get_domains = reinterpret_cast<PFN_vkGetPhysicalDeviceCalibrateableTimeDomainsEXT>(
        vkGetInstanceProcAddr(g_instance ? g_instance->handle : VK_NULL_HANDLE,
                              "vkGetPhysicalDeviceCalibrateableTimeDomainsEXT"));
    if (get_domains) {
      uint32_t nd = 0;
      get_domains(pd, &nd, nullptr);
      std::vector<VkTimeDomainEXT> doms(nd);
      get_domains(pd, &nd, doms.data());
      bool dev = false, mono = false;
      for (auto t : doms) {
        dev |= t == VK_TIME_DOMAIN_DEVICE_EXT;
        mono |= t == VK_TIME_DOMAIN_CLOCK_MONOTONIC_EXT;
      }
      d.calibrated_timestamps = dev && mono;
    }
  }

  // Memory: unified when a DEVICE_LOCAL|HOST_VISIBLE type lives on the largest
  // device-local heap (lavapipe, integrated GPUs, full ReBAR) -- a small BAR heap
  // on a discrete GPU does not count.
  vkGetPhysicalDeviceMemoryProperties(pd, &d.memory);
  int largest = -1;
  for (uint32_t h = 0; h < d.memory.memoryHeapCount; ++h) {
    const auto& heap = d.memory.memoryHeaps[h];
    if (!(heap.flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT)) continue;
    d.device_local_bytes += heap.size;
    if (largest < 0 || heap.size > d.memory.memoryHeaps[largest].size) largest = int(h);
  }
  const VkMemoryPropertyFlags uni = VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT;
  for (uint32_t t = 0; t < d.memory.memoryTypeCount; ++t) {
    const auto& mt = d.memory.memoryTypes[t];
    if ((mt.propertyFlags & uni) == uni && int(mt.heapIndex) == largest) d.unified_memory = true;
  }

  uint32_t ts_bits = 0;
  if (pick_queue_family(pd, d.queue_family, ts_bits)) {
    d.timestamp_valid_bits = ts_bits;
  } else {
    d.type_rank = 99;  // no compute queue: unusable, filtered out by the caller
  }
  return d;
}

}  // namespace

Instance::~Instance() {
  if (handle) vkDestroyInstance(handle, nullptr);
}

std::string version_string(uint32_t v) {
  return std::to_string(VK_API_VERSION_MAJOR(v)) + "." + std::to_string(VK_API_VERSION_MINOR(v)) + "." +
         std::to_string(VK_API_VERSION_PATCH(v));
}

std::shared_ptr<Instance> get_instance() {
  if (g_instance) return g_instance;

  uint32_t loader_api = VK_API_VERSION_1_0;
  // vkEnumerateInstanceVersion exists from loader 1.1 on; a 1.0 loader lacks the symbol.
  auto enum_version =
      reinterpret_cast<PFN_vkEnumerateInstanceVersion>(vkGetInstanceProcAddr(VK_NULL_HANDLE, "vkEnumerateInstanceVersion"));
  if (enum_version) enum_version(&loader_api);
  if (loader_api < VK_API_VERSION_1_1) {
    g_last_error = "the Vulkan loader supports only " + version_string(loader_api) + "; Helios needs Vulkan 1.1 or newer";
    return nullptr;
  }

  uint32_t n_iext = 0;
  vkEnumerateInstanceExtensionProperties(nullptr, &n_iext, nullptr);
  std::vector<VkExtensionProperties> iexts(n_iext);
  vkEnumerateInstanceExtensionProperties(nullptr, &n_iext, iexts.data());

  VkApplicationInfo app{VK_STRUCTURE_TYPE_APPLICATION_INFO};
  app.pApplicationName = "helios";
  app.pEngineName = "helios";
  app.apiVersion = std::min(loader_api, uint32_t(VK_API_VERSION_1_3));

  std::vector<const char*> enabled;
  VkInstanceCreateInfo ci{VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO};
  // Portability drivers (MoltenVK) are listed only when we opt in.
  if (has_extension(iexts, VK_KHR_PORTABILITY_ENUMERATION_EXTENSION_NAME)) {
    enabled.push_back(VK_KHR_PORTABILITY_ENUMERATION_EXTENSION_NAME);
    ci.flags |= VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR;
  }
  ci.pApplicationInfo = &app;
  ci.enabledExtensionCount = uint32_t(enabled.size());
  ci.ppEnabledExtensionNames = enabled.data();

  auto inst = std::make_shared<Instance>();
  inst->api_version = app.apiVersion;
  VkResult r = vkCreateInstance(&ci, nullptr, &inst->handle);
  if (r != VK_SUCCESS) {
    inst->handle = VK_NULL_HANDLE;
    g_last_error = std::string("vkCreateInstance failed: ") + result_name(r);
    return nullptr;
  }

  uint32_t n = 0;
  r = vkEnumeratePhysicalDevices(inst->handle, &n, nullptr);
  if (r < 0) {
    g_last_error = std::string("vkEnumeratePhysicalDevices failed: ") + result_name(r);
    return nullptr;
  }
  std::vector<VkPhysicalDevice> pds(n);
  vkEnumeratePhysicalDevices(inst->handle, &n, pds.data());
  pds.resize(n);

  g_instance = inst;  // describe() needs the instance for instance-level entry points
  for (auto pd : pds) {
    PhysicalDeviceInfo d = describe(pd, inst->api_version);
    if (d.type_rank <= 4) inst->devices.push_back(std::move(d));
  }
  // Stable: devices of one type keep the driver's order.
  std::stable_sort(inst->devices.begin(), inst->devices.end(),
                   [](const PhysicalDeviceInfo& a, const PhysicalDeviceInfo& b) { return a.type_rank < b.type_rank; });
  for (size_t i = 0; i < inst->devices.size(); ++i) inst->devices[i].index = int(i);

  if (inst->devices.empty()) {
    g_instance.reset();
    g_last_error = n == 0 ? "vkEnumeratePhysicalDevices found no Vulkan device (is a driver such as Mesa lavapipe installed?)"
                          : "no Vulkan device has a compute queue";
    return nullptr;
  }
  g_last_error.clear();
  return g_instance;
}

const std::string& last_error() { return g_last_error; }

void release_instance() { g_instance.reset(); }

}  // namespace helios_vk
