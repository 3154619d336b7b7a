// Compute pipelines: descriptor-set layouts per buffer count, pipeline layouts
// per (buffer count, push size), pipelines cached in memory by (SPIR-V hash,
// layout, specialization) and on disk through a VkPipelineCache.
#pragma once

#include <vulkan/vulkan.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "instance.h"

namespace helios_vk {

struct Pipeline {
  VkPipeline pipeline = VK_NULL_HANDLE;
  VkPipelineLayout layout = VK_NULL_HANDLE;
  VkDescriptorSetLayout set_layout = VK_NULL_HANDLE;
  uint32_t num_buffers = 0;
  uint32_t push_size = 0;
  uint32_t texel_mask = 0;       // bit b: binding b is a uniform texel buffer, not a storage buffer
  uint32_t texel_uint_mask = 0;  // bit b: that texel buffer is an rgba32ui view (a usamplerBuffer), else rgba32f
  bool push_descriptor = false;  // bindings go through vkCmdPushDescriptorSetKHR
  std::string name;
};

class Pipelines {
 public:
  // max_bindings caps num_buffers (descriptor limits of the device).
  Pipelines(VkDevice dev, const PhysicalDeviceInfo& info, bool use_push_descriptors, std::string cache_dir);
  ~Pipelines();
  Pipelines(const Pipelines&) = delete;
  Pipelines& operator=(const Pipelines&) = delete;

  // The id of the pipeline for this SPIR-V and layout, creating it on first use.
  // subgroup_size > 0: the required subgroup size (full subgroups where the device can promise them).
  uint32_t get_or_create(const uint8_t* spirv, size_t nbytes, uint32_t num_buffers, uint32_t push_size,
                         const std::vector<uint32_t>& spec, const std::string& name, uint32_t subgroup_size = 0);

  const Pipeline* find(uint64_t id) const { return id < pipelines_.size() ? &pipelines_[id] : nullptr; }
  size_t size() const { return pipelines_.size(); }

  // Writes the VkPipelineCache to cache_dir (temp file, fsync, rename).  No-op without a dir.
  void save_cache();
  std::string cache_path() const;
  bool cache_loaded() const { return cache_loaded_; }

  static constexpr uint32_t kMaxBuffers = 32;

 private:
  struct Key {
    uint64_t hash;
    uint32_t num_buffers, push_size, subgroup_size;
    std::vector<uint32_t> spec;
    bool operator<(const Key& o) const {
      if (hash != o.hash) return hash < o.hash;
      if (num_buffers != o.num_buffers) return num_buffers < o.num_buffers;
      if (push_size != o.push_size) return push_size < o.push_size;
      if (subgroup_size != o.subgroup_size) return subgroup_size < o.subgroup_size;
      return spec < o.spec;
    }
  };
  VkDescriptorSetLayout set_layout(uint32_t num_buffers, uint32_t texel_mask, bool& push);
  VkPipelineLayout pipeline_layout(uint32_t num_buffers, uint32_t texel_mask, uint32_t push_size);
  void load_cache();

  VkDevice dev_;
  const PhysicalDeviceInfo& info_;
  bool use_push_;
  std::string cache_dir_;
  bool cache_loaded_ = false;
  VkPipelineCache cache_ = VK_NULL_HANDLE;
  std::map<std::pair<uint32_t, uint32_t>, std::pair<VkDescriptorSetLayout, bool>> set_layouts_;  // (buffers, texel mask)
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, VkPipelineLayout> layouts_;  // (buffers, texel mask, push size)
  std::map<Key, std::vector<std::pair<std::vector<uint8_t>, uint32_t>>> by_key_;  // SPIR-V compared on hit
  std::vector<Pipeline> pipelines_;
};

// 64-bit hash of a byte string (SPIR-V keys).
uint64_t hash_bytes(const uint8_t* p, size_t n);

}  // namespace helios_vk
