// The Vulkan instance, physical-device enumeration and what we learn about
// each device (limits, features, memory, the compute queue family).
#pragma once

#include <vulkan/vulkan.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

namespace helios_vk {

// VK_KHR_cooperative_matrix, spelled out here: the headers this addon may be built against
// (1.3.239) predate it (1.3.255).  The values and layouts are the registry's.
constexpr const char* kCoopMatExtension = "VK_KHR_cooperative_matrix";
constexpr VkStructureType kCoopMatFeaturesSType = VkStructureType(1000506000);
constexpr VkStructureType kCoopMatPropertiesSType = VkStructureType(1000506001);
struct CoopMatFeaturesKHR {  // VkPhysicalDeviceCooperativeMatrixFeaturesKHR
  VkStructureType sType = kCoopMatFeaturesSType;
  void* pNext = nullptr;
  VkBool32 cooperativeMatrix = VK_FALSE;
  VkBool32 cooperativeMatrixRobustBufferAccess = VK_FALSE;
};
struct CoopMatPropertiesKHR {  // VkCooperativeMatrixPropertiesKHR
  VkStructureType sType = kCoopMatPropertiesSType;
  void* pNext = nullptr;
  uint32_t MSize = 0, NSize = 0, KSize = 0;
  int32_t AType = 0, BType = 0, CType = 0, ResultType = 0;  // VkComponentTypeKHR
  VkBool32 saturatingAccumulation = VK_FALSE;
  int32_t scope = 0;  // VkScopeKHR
};

// VK_KHR_shader_bfloat16, spelled out the same way (the headers predate it too): bfloat16 as a
// cooperative-matrix component type (VK_COMPONENT_TYPE_BFLOAT16_KHR).
constexpr const char* kBf16Extension = "VK_KHR_shader_bfloat16";
constexpr VkStructureType kBf16FeaturesSType = VkStructureType(1000141000);
constexpr int32_t kComponentBf16 = 1000141000;
struct Bf16FeaturesKHR {  // VkPhysicalDeviceShaderBfloat16FeaturesKHR
  VkStructureType sType = kBf16FeaturesSType;
  void* pNext = nullptr;
  VkBool32 shaderBFloat16Type = VK_FALSE;
  VkBool32 shaderBFloat16DotProduct = VK_FALSE;
  VkBool32 shaderBFloat16CooperativeMatrix = VK_FALSE;
};

// One cooperative-matrix shape the device lists: C[M x N] += A[M x K] B[K x N].
struct CoopMatShape {
  uint32_t m = 0, n = 0, k = 0;
  int32_t a = 0, b = 0, c = 0, result = 0;  // VkComponentTypeKHR
  int32_t scope = 0;                         // VkScopeKHR
  bool saturating = false;
};

// Everything the rest of the addon (and Python, via info dicts) needs to know
// about one physical device.  Filled once per instance.
struct PhysicalDeviceInfo {
  VkPhysicalDevice handle = VK_NULL_HANDLE;
  int index = 0;  // position in the sorted list (what Device(index) takes)
  std::string name;
  std::string type;  // "discrete" | "integrated" | "virtual" | "cpu" | "other"
  int type_rank = 4;
  uint32_t vendor_id = 0, device_id = 0, driver_version = 0, api_version = 0;
  std::array<uint8_t, VK_UUID_SIZE> pipeline_cache_uuid{};

  // Limits exposed to Python.
  uint64_t max_storage_buffer_range = 0;
  uint32_t max_shared_memory = 0;
  uint32_t max_workgroup_invocations = 0;
  uint32_t max_workgroup_size[3] = {0, 0, 0};
  uint32_t max_workgroup_count[3] = {0, 0, 0};
  uint32_t max_push_constants = 0;
  uint64_t min_storage_buffer_offset_alignment = 0;
  uint64_t min_texel_buffer_offset_alignment = 0;
  uint64_t max_texel_buffer_elements = 0;
  float timestamp_period = 0.f;
  uint32_t timestamp_valid_bits = 0;  // of the chosen queue family
  uint32_t subgroup_size = 0;
  // Subgroup sizes a compute pipeline may require (Vulkan 1.3's subgroupSizeControl with the
  // compute stage among requiredSubgroupSizeStages); 0 where it cannot require one.
  uint32_t min_subgroup_size = 0, max_subgroup_size = 0;
  uint64_t max_memory_allocation_size = 0;
  // Limits used internally only.
  uint64_t max_buffer_size = 0;  // 0 = unknown (pre-1.3 device)
  uint64_t non_coherent_atom_size = 1;
  uint32_t max_push_descriptors = 0;

  // Features exposed to Python.
  bool float16 = false, storage16 = false, storage8 = false, int64 = false, int16 = false;
  bool push_descriptor = false, calibrated_timestamps = false, unified_memory = false;
  bool timeline_semaphore = false;  // Vulkan 1.2's timelineSemaphore feature (the stream's completion tracking)
  // Vulkan 1.3's computeFullSubgroups: a pipeline that requires a subgroup size may also require
  // every subgroup to be full (enabled with subgroupSizeControl where min_subgroup_size > 0).
  bool compute_full_subgroups = false;
  // VK_KHR_cooperative_matrix's shapes, listed where the device can run Helios' cooperative-matrix
  // kernel: the extension with its cooperativeMatrix feature, Vulkan 1.3 (SPIR-V 1.6) and the
  // vulkanMemoryModel feature its shaders declare; the Device enables all three then.  Empty
  // otherwise (lavapipe, older GPUs and drivers).
  std::vector<CoopMatShape> coopmat;
  // Whether coopmat lists bf16 shapes: VK_KHR_shader_bfloat16 with its shaderBFloat16Type and
  // shaderBFloat16CooperativeMatrix features, which the Device then enables (bf16 shapes are
  // dropped from coopmat where it cannot).
  bool bf16_coopmat = false;
  uint64_t device_local_bytes = 0;

  // How to enable them: core (api >= 1.2) or via the KHR extension names.
  bool has_ext_16bit_storage = false, has_ext_8bit_storage = false, has_ext_float16_int8 = false;
  // Enabled where present but not listed in the Python dict (the brief fixes its keys):
  // 8-bit integer arithmetic, which shaders using uint8_t values beyond load/store need.
  bool int8 = false;

  uint32_t queue_family = 0;
  VkPhysicalDeviceMemoryProperties memory{};
};

// The process-wide instance.  Devices hold a shared_ptr so the instance
// outlives every logical device made from it.
struct Instance {
  VkInstance handle = VK_NULL_HANDLE;
  uint32_t api_version = 0;
  std::vector<PhysicalDeviceInfo> devices;  // sorted discrete, integrated, virtual, cpu, other
  ~Instance();
};

// The instance, created on first use.  nullptr if there is no loader, no
// instance or no device; last_error() then says why.
std::shared_ptr<Instance> get_instance();

// Why the last get_instance() failed ("" if it did not).
const std::string& last_error();

// Drops the module's reference (at interpreter exit); live Devices keep theirs.
void release_instance();

// "1.3.239" from a packed Vulkan version.
std::string version_string(uint32_t v);

}  // namespace helios_vk
