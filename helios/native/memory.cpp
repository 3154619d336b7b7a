// Pools, blocks, size classes, deferred frees.
//
// Why this shape: vkAllocateMemory is slow and drivers cap the number of live
// allocations (often 4096), so tensors are carved out of large blocks.  Each
// pool (weights, activations, staging) has its own blocks so long-lived weights
// do not pin blocks that short-lived activations fragment.  Sizes round up to a
// size class (4 classes per power of two, so at most 25% waste above 1 KiB) and
// freed ranges go to that class's free list for exact reuse: training loops
// allocate the same shapes every step, so the lists settle after one step.
#include "memory.h"

#include <algorithm>
#include <cstring>

namespace helios_vk {

const char* pool_name(int pool) {
  switch (pool) {
    case kWeights: return "weights";
    case kActivations: return "activations";
    case kStaging: return "staging";
    default: return "?";
  }
}

int pool_from_name(const char* name, size_t len) {
  for (int p = 0; p < kNumPools; ++p)
    if (std::strlen(pool_name(p)) == len && std::memcmp(pool_name(p), name, len) == 0) return p;
  return -1;
}

uint64_t Allocator::class_size(uint64_t n, uint64_t align) {
  if (n <= align) return align;
  int lg = 63 - __builtin_clzll(n - 1);  // 2^lg < n <= 2^(lg+1)
  uint64_t step = std::max<uint64_t>(uint64_t(1) << (lg >= 2 ? lg - 2 : 0), align);
  return align_up(n, step);
}

int Allocator::class_index(uint64_t rounded) {
  // rounded is a class size: 2^lg < rounded <= 2^(lg+1), k quarter-steps above 2^lg.
  if (rounded <= 256) return 0;
  int lg = 63 - __builtin_clzll(rounded - 1);
  uint64_t step = uint64_t(1) << (lg - 2);
  uint64_t k = (rounded - (uint64_t(1) << lg) + step - 1) / step;  // 1..4
  int idx = 1 + (lg - 8) * 4 + int(k) - 1;
  return std::min(idx, kClasses - 1);
}

Allocator::Allocator(VkDevice dev, const PhysicalDeviceInfo& info, bool force_staging, uint64_t block_size,
                     uint64_t budget)
    : dev_(dev), info_(info), budget_(budget) {
  // Offsets must satisfy storage-buffer binding (minStorageBufferOffsetAlignment,
  // <= 256 by the spec) and we keep 256 so typed views of any element size align.
  align_ = std::max<uint64_t>(256, info.min_storage_buffer_offset_alignment);
  block_size_ = std::min<uint64_t>(block_size, info.max_memory_allocation_size);
  if (info.max_buffer_size) block_size_ = std::min<uint64_t>(block_size_, info.max_buffer_size);
  block_size_ = std::max<uint64_t>(block_size_ / align_ * align_, align_);
  // Uniform texel buffer too: kernels may read an operand through an rgba32f or rgba32ui view (a samplerBuffer or
  // usamplerBuffer), which CPU drivers load as one gather per texel where a storage-buffer load is a loop over the lanes.
  usage_ = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_UNIFORM_TEXEL_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
           VK_BUFFER_USAGE_TRANSFER_DST_BIT;

  for (int p = 0; p < kNumPools; ++p) {
    bool hv = false, coh = true;
    pools_[p].memory_type = pick_memory_type(p, hv, coh);
    // Forcing staging (a test switch) keeps device pools unmapped so the
    // discrete-GPU transfer path runs on unified-memory devices too.
    pools_[p].map = hv && !(force_staging && p != kStaging);
    pools_[p].coherent = coh;
  }
}

Allocator::~Allocator() {
  for (auto& b : blocks_)
    if (b) destroy_block(b.get());
  blocks_.clear();
}

uint32_t Allocator::pick_memory_type(int pool, bool& host_visible, bool& coherent) const {
  // The memory types a storage buffer may live in.
  VkBufferCreateInfo bci{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  bci.size = 4096;
  bci.usage = usage_;
  bci.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  VkBuffer probe = VK_NULL_HANDLE;
  check(vkCreateBuffer(dev_, &bci, nullptr, &probe), "vkCreateBuffer");
  VkMemoryRequirements req;
  vkGetBufferMemoryRequirements(dev_, probe, &req);
  vkDestroyBuffer(dev_, probe, nullptr);

  const auto& mp = info_.memory;
  int largest_dl = -1;
  for (uint32_t h = 0; h < mp.memoryHeapCount; ++h)
    if ((mp.memoryHeaps[h].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) &&
        (largest_dl < 0 || mp.memoryHeaps[h].size > mp.memoryHeaps[largest_dl].size))
      largest_dl = int(h);

  const VkMemoryPropertyFlags DL = VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, HV = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT,
                              HC = VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, CA = VK_MEMORY_PROPERTY_HOST_CACHED_BIT;
  struct Want {
    VkMemoryPropertyFlags flags;
    bool on_largest_dl;
  };
  // Staging: cached makes readback fast; coherent avoids flushes.  Device pools:
  // device-local and mappable on the big heap (unified memory) avoids staging copies.
  const std::vector<Want> order =
      pool == kStaging ? std::vector<Want>{{HV | HC | CA, false}, {HV | HC, false}, {HV | CA, false}, {HV, false}}
                       : std::vector<Want>{{DL | HV | HC, true}, {DL | HV, true}, {DL, true}, {DL, false}, {0, false}};
  for (const auto& w : order) {
    for (uint32_t t = 0; t < mp.memoryTypeCount; ++t) {
      if (!(req.memoryTypeBits & (1u << t))) continue;
      const auto& mt = mp.memoryTypes[t];
      if ((mt.propertyFlags & w.flags) != w.flags) continue;
      if (w.on_largest_dl && int(mt.heapIndex) != largest_dl) continue;
      host_visible = mt.propertyFlags & HV;
      coherent = mt.propertyFlags & HC;
      return t;
    }
  }
  throw VulkanError("vkGetBufferMemoryRequirements (no usable memory type)", VK_ERROR_FEATURE_NOT_PRESENT);
}

Block* Allocator::create_block(int pool, uint64_t size, bool dedicated) {
  if (budget_ && reserved_total_ + size > budget_) return nullptr;
  auto b = std::make_unique<Block>();
  b->size = size;
  b->pool = uint8_t(pool);
  b->dedicated = dedicated;
  b->coherent = pools_[pool].coherent;

  VkBufferCreateInfo bci{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  bci.size = size;
  bci.usage = usage_;
  bci.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  check(vkCreateBuffer(dev_, &bci, nullptr, &b->buffer), "vkCreateBuffer");
  VkMemoryRequirements req;
  vkGetBufferMemoryRequirements(dev_, b->buffer, &req);

  VkMemoryAllocateInfo mai{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO};
  mai.allocationSize = req.size;
  mai.memoryTypeIndex = pools_[pool].memory_type;
  VkMemoryDedicatedAllocateInfo dai{VK_STRUCTURE_TYPE_MEMORY_DEDICATED_ALLOCATE_INFO};
  if (dedicated) {
    // Lets drivers place big tensors optimally (core in 1.1).
    dai.buffer = b->buffer;
    mai.pNext = &dai;
  }
  VkResult r = vkAllocateMemory(dev_, &mai, nullptr, &b->memory);
  if (r == VK_ERROR_OUT_OF_DEVICE_MEMORY || r == VK_ERROR_OUT_OF_HOST_MEMORY) {
    vkDestroyBuffer(dev_, b->buffer, nullptr);
    return nullptr;
  }
  if (r < 0) {
    vkDestroyBuffer(dev_, b->buffer, nullptr);
    throw VulkanError("vkAllocateMemory", r);
  }
  const char* failed = "vkBindBufferMemory";
  r = vkBindBufferMemory(dev_, b->buffer, b->memory, 0);
  if (r == VK_SUCCESS && pools_[pool].map) {
    void* p = nullptr;
    failed = "vkMapMemory";
    r = vkMapMemory(dev_, b->memory, 0, VK_WHOLE_SIZE, 0, &p);
    b->mapped = static_cast<uint8_t*>(p);
  }
  if (r < 0) {
    vkDestroyBuffer(dev_, b->buffer, nullptr);
    vkFreeMemory(dev_, b->memory, nullptr);
    throw VulkanError(failed, r);
  }

  if (!free_block_ids_.empty()) {
    b->id = free_block_ids_.back();
    free_block_ids_.pop_back();
  } else {
    b->id = uint32_t(blocks_.size());
    blocks_.emplace_back();
  }
  Block* raw = b.get();
  blocks_[raw->id] = std::move(b);
  auto& st = stats_[pool];
  st.reserved_bytes += size;
  reserved_total_ += size;
  (dedicated ? st.dedicated : st.blocks) += 1;
  if (!dedicated) pools_[pool].blocks.push_back(raw);
  return raw;
}

void Allocator::destroy_block(Block* b) {
  reserved_total_ -= b->size;
  for (auto& kv : b->texel_views) vkDestroyBufferView(dev_, kv.second, nullptr);
  b->texel_views.clear();
  if (b->mapped) vkUnmapMemory(dev_, b->memory);
  vkDestroyBuffer(dev_, b->buffer, nullptr);
  vkFreeMemory(dev_, b->memory, nullptr);
}

void Allocator::check_device_limits(uint64_t nbytes, int pool) const {
  const auto& mp = info_.memory;
  uint64_t heap = mp.memoryHeaps[mp.memoryTypes[pools_[pool].memory_type].heapIndex].size;
  const char* what = nullptr;
  uint64_t limit = 0;
  if (nbytes > info_.max_memory_allocation_size) {
    what = "maxMemoryAllocationSize", limit = info_.max_memory_allocation_size;
  } else if (info_.max_buffer_size && nbytes > info_.max_buffer_size) {
    what = "maxBufferSize", limit = info_.max_buffer_size;
  } else if (nbytes > heap) {
    what = "memory heap size", limit = heap;
  }
  if (what)
    throw OutOfMemory(strf("cannot allocate %llu bytes in pool '%s': above the device limit %s of %llu bytes on '%s'. "
                           "Split the tensor into smaller ones. Pools: %s",
                           (unsigned long long)nbytes, pool_name(pool), what, (unsigned long long)limit,
                           info_.name.c_str(), pools_summary().c_str()));
}

uint64_t Allocator::new_slot() {
  if (!free_slots_.empty()) {
    uint32_t i = free_slots_.back();
    free_slots_.pop_back();
    return i;
  }
  // Index 0 is reserved so that handle 0 is never valid.
  if (slots_.empty()) slots_.emplace_back();
  slots_.emplace_back();
  return slots_.size() - 1;
}

uint64_t Allocator::try_alloc(uint64_t nbytes, int pool) {
  PoolState& ps = pools_[pool];
  Block* block = nullptr;
  uint64_t offset = 0, rounded;
  int32_t cls = -1;

  if (nbytes > block_size_ / 2) {
    // Dedicated: one VkDeviceMemory + VkBuffer of its own; sub-allocating it
    // would waste up to half a block.
    rounded = align_up(nbytes, align_);
    check_device_limits(rounded, pool);
    block = create_block(pool, rounded, true);
    if (!block) return 0;
  } else {
    rounded = class_size(nbytes, align_);
    cls = class_index(rounded);
    auto& fl = ps.free_lists[cls];
    if (!fl.empty()) {
      block = fl.back().first;
      offset = fl.back().second;
      fl.pop_back();
    } else {
      // Bump-allocate from the newest block with room, else a fresh block.
      for (auto it = ps.blocks.rbegin(); it != ps.blocks.rend(); ++it) {
        uint64_t off = align_up((*it)->bump, align_);
        if (off + rounded <= (*it)->size) {
          block = *it;
          offset = off;
          break;
        }
      }
      if (!block) {
        block = create_block(pool, block_size_, false);
        if (!block) return 0;
        offset = 0;
      }
      block->bump = offset + rounded;
    }
  }
  block->live += 1;

  uint64_t idx = new_slot();
  Allocation& a = slots_[idx];
  a.block = block;
  a.offset = offset;
  a.size = nbytes;
  a.rounded = rounded;
  a.cls = cls;
  a.pool = uint8_t(pool);
  a.live = true;

  auto& st = stats_[pool];
  st.allocs += 1;
  st.in_use_bytes += rounded;
  st.peak_in_use_bytes = std::max(st.peak_in_use_bytes, st.in_use_bytes);
  return (uint64_t(a.gen) << 32) | idx;
}

void Allocator::throw_bad_handle(uint64_t handle) const {
  uint64_t idx = handle & 0xffffffffull;
  if (idx != 0 && idx < slots_.size() && slots_[idx].gen == uint32_t(handle >> 32) + 1 && !slots_[idx].live)
    throw ArgError(strf("handle %llu was already freed (double free, or use after free)", (unsigned long long)handle));
  throw ArgError(strf("unknown memory handle %llu: pass a handle returned by alloc() that is not freed",
                      (unsigned long long)handle));
}

void Allocator::free(uint64_t handle, uint64_t serial) {
  Allocation& a = get(handle);
  auto& st = stats_[a.pool];
  st.frees += 1;
  st.in_use_bytes -= a.rounded;
  st.pending_free_bytes += a.rounded;
  pending_.push_back({serial, a.block, a.offset, a.rounded, a.cls, a.pool});
  a.live = false;
  a.block = nullptr;
  a.gen += 1;  // stale copies of this handle now fail get()
  if (a.gen == 0) a.gen = 1;
  free_slots_.push_back(uint32_t(handle & 0xffffffffull));
}

void Allocator::reclaim(uint64_t completed) {
  while (!pending_.empty() && pending_.front().serial <= completed) {
    Pending p = pending_.front();
    pending_.pop_front();
    auto& st = stats_[p.pool];
    st.pending_free_bytes -= p.rounded;
    p.block->live -= 1;
    if (p.block->dedicated) {
      st.reserved_bytes -= p.block->size;
      st.dedicated -= 1;
      uint32_t id = p.block->id;
      destroy_block(p.block);
      blocks_[id].reset();
      free_block_ids_.push_back(id);
    } else {
      pools_[p.pool].free_lists[p.cls].emplace_back(p.block, p.offset);
    }
  }
}

void Allocator::trim() {
  for (int p = 0; p < kNumPools; ++p) {
    PoolState& ps = pools_[p];
    std::vector<Block*> keep;
    bool any = false;
    for (Block* b : ps.blocks) {
      if (b->live == 0) {
        b->bump = UINT64_MAX;  // mark for removal from the free lists below
        any = true;
      } else {
        keep.push_back(b);
      }
    }
    if (!any) continue;
    for (auto& fl : ps.free_lists)
      fl.erase(std::remove_if(fl.begin(), fl.end(), [](const std::pair<Block*, uint64_t>& e) { return e.first->bump == UINT64_MAX; }),
               fl.end());
    for (Block* b : ps.blocks) {
      if (b->bump != UINT64_MAX) continue;
      stats_[p].reserved_bytes -= b->size;
      stats_[p].blocks -= 1;
      uint32_t id = b->id;
      destroy_block(b);
      blocks_[id].reset();
      free_block_ids_.push_back(id);
    }
    ps.blocks = std::move(keep);
  }
}

std::string Allocator::pools_summary() const {
  std::string s;
  for (int p = 0; p < kNumPools; ++p) {
    const auto& st = stats_[p];
    s += strf("%s%s: reserved %llu B, in use %llu B, awaiting free %llu B", p ? "; " : "", pool_name(p),
              (unsigned long long)st.reserved_bytes, (unsigned long long)st.in_use_bytes,
              (unsigned long long)st.pending_free_bytes);
  }
  return s;
}

VkMappedMemoryRange Allocator::atom_range(Block* b, uint64_t offset, uint64_t n) const {
  // Non-coherent ranges must be aligned to nonCoherentAtomSize (clamped to the allocation).
  uint64_t atom = info_.non_coherent_atom_size;
  VkMappedMemoryRange r{VK_STRUCTURE_TYPE_MAPPED_MEMORY_RANGE};
  r.memory = b->memory;
  r.offset = offset / atom * atom;
  uint64_t end = std::min(align_up(offset + n, atom), b->size);
  r.size = end == b->size ? VK_WHOLE_SIZE : end - r.offset;
  return r;
}

void Allocator::flush(Block* b, uint64_t offset, uint64_t n) {
  if (b->coherent || n == 0) return;
  VkMappedMemoryRange r = atom_range(b, offset, n);
  check(vkFlushMappedMemoryRanges(dev_, 1, &r), "vkFlushMappedMemoryRanges");
}

void Allocator::invalidate(Block* b, uint64_t offset, uint64_t n) {
  if (b->coherent || n == 0) return;
  VkMappedMemoryRange r = atom_range(b, offset, n);
  check(vkInvalidateMappedMemoryRanges(dev_, 1, &r), "vkInvalidateMappedMemoryRanges");
}

}  // namespace helios_vk
