// Device memory: pools by lifetime, large blocks sub-allocated by size class,
// dedicated allocations for large requests, deferred frees.
#pragma once

#include <vulkan/vulkan.h>

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "hazards.h"

#include "instance.h"
#include "vk_util.h"

namespace helios_vk {

enum PoolId : uint8_t { kWeights = 0, kActivations = 1, kStaging = 2, kNumPools = 3 };
const char* pool_name(int pool);
int pool_from_name(const char* name, size_t len);  // -1 if unknown

// One VkDeviceMemory with one VkBuffer covering it.
struct Block {
  VkDeviceMemory memory = VK_NULL_HANDLE;
  VkBuffer buffer = VK_NULL_HANDLE;
  uint64_t size = 0;
  uint8_t* mapped = nullptr;  // persistent mapping, nullptr if not host-visible (or staging forced)
  bool coherent = true;
  bool dedicated = false;
  uint8_t pool = 0;
  uint32_t id = 0;
  uint64_t bump = 0;  // first never-handed-out byte (sub-allocated blocks)
  uint32_t live = 0;  // ranges handed out and not yet reclaimed
  uint64_t last_serial = 0;  // newest submission serial that recorded an access (set by the stream)
  BufferHazards hazards;     // owned by the stream's HazardTracker
  // rgba32f / rgba32ui views of ranges of `buffer` bound as uniform texel buffers, by (offset,
  // range, rgba32ui); made on first use by a dispatch, destroyed with the block.
  std::map<std::tuple<uint64_t, uint64_t, bool>, VkBufferView> texel_views;
};

struct Allocation {
  Block* block = nullptr;
  uint64_t offset = 0;   // in block->buffer
  uint64_t size = 0;     // requested
  uint64_t rounded = 0;  // size class (or aligned size for dedicated)
  int32_t cls = -1;      // size-class index, -1 for dedicated
  uint32_t gen = 1;      // handle generation: stale handles are detected
  uint8_t pool = 0;
  bool live = false;
};

struct PoolStats {
  uint64_t blocks = 0, dedicated = 0, reserved_bytes = 0, in_use_bytes = 0, peak_in_use_bytes = 0;
  uint64_t allocs = 0, frees = 0, pending_free_bytes = 0;
};

class Allocator {
 public:
  static constexpr int kClasses = 4 * 48;

  // budget: cap on reserved bytes over all pools (0 = none); beyond it block
  // creation fails as vkAllocateMemory would, so the out-of-memory path runs.
  Allocator(VkDevice dev, const PhysicalDeviceInfo& info, bool force_staging, uint64_t block_size, uint64_t budget = 0);
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // A new allocation.  Returns 0 when vkAllocateMemory ran out of memory (the
  // caller synchronizes, reclaims and retries); throws OutOfMemory for requests
  // above a device limit and VulkanError for other failures.
  uint64_t try_alloc(uint64_t nbytes, int pool);

  // The live allocation behind a handle; ArgError for unknown or freed handles.
  inline Allocation& get(uint64_t handle) {
    uint64_t idx = handle & 0xffffffffull;
    if (idx < slots_.size()) {
      Allocation& a = slots_[idx];
      if (a.live && a.gen == uint32_t(handle >> 32)) return a;
    }
    throw_bad_handle(handle);
  }

  // Frees a handle; the range returns to its free list once `serial` completed.
  void free(uint64_t handle, uint64_t serial);
  // Returns every deferred range whose serial <= completed to its free list.
  void reclaim(uint64_t completed);
  bool has_pending() const { return !pending_.empty(); }
  uint64_t oldest_pending_serial() const { return pending_.empty() ? UINT64_MAX : pending_.front().serial; }
  // Releases blocks that hold no live range (used before retrying a failed allocation).
  void trim();

  const PoolStats& stats(int pool) const { return stats_[pool]; }
  std::string pools_summary() const;  // "weights: reserved X B, in use Y B; ..."
  uint64_t block_size() const { return block_size_; }
  uint64_t budget() const { return budget_; }
  uint64_t alignment() const { return align_; }
  bool pool_is_mapped(int pool) const { return pools_[pool].map; }

  // Host-visible access helpers: flush/invalidate for non-coherent memory.
  void flush(Block* b, uint64_t offset, uint64_t n);
  void invalidate(Block* b, uint64_t offset, uint64_t n);
  // The nonCoherentAtomSize-aligned range covering [offset, offset + n) of ``b``.
  VkMappedMemoryRange atom_range(Block* b, uint64_t offset, uint64_t n) const;

  // Size class of a request (bytes actually reserved) and its index.
  static uint64_t class_size(uint64_t n, uint64_t align);
  static int class_index(uint64_t rounded);

 private:
  struct PoolState {
    uint32_t memory_type = 0;
    bool map = false;
    bool coherent = true;
    std::vector<Block*> blocks;  // sub-allocated blocks, newest last
    std::array<std::vector<std::pair<Block*, uint64_t>>, kClasses> free_lists;
  };
  struct Pending {
    uint64_t serial;
    Block* block;
    uint64_t offset, rounded;
    int32_t cls;
    uint8_t pool;
  };

  [[noreturn]] void throw_bad_handle(uint64_t handle) const;
  uint32_t pick_memory_type(int pool, bool& host_visible, bool& coherent) const;
  // Creates a block (VkBuffer + VkDeviceMemory); nullptr on VK_ERROR_OUT_OF_*_MEMORY.
  Block* create_block(int pool, uint64_t size, bool dedicated);
  void destroy_block(Block* b);
  void check_device_limits(uint64_t nbytes, int pool) const;
  uint64_t new_slot();

  VkDevice dev_;
  const PhysicalDeviceInfo& info_;
  uint64_t block_size_;
  uint64_t budget_;
  uint64_t reserved_total_ = 0;
  uint64_t align_;
  VkBufferUsageFlags usage_;
  std::array<PoolState, kNumPools> pools_;
  std::array<PoolStats, kNumPools> stats_;
  std::vector<std::unique_ptr<Block>> blocks_;  // by id; nullptr where released
  std::vector<uint32_t> free_block_ids_;
  std::vector<Allocation> slots_;
  std::vector<uint32_t> free_slots_;
  std::deque<Pending> pending_;  // serials never decrease, so this stays sorted
};

}  // namespace helios_vk
