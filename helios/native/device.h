// The logical device: the one object Python talks to.  It owns the allocator,
// the pipelines and the command stream, validates every argument, and turns
// host transfers and ops into stream commands.
#pragma once

#include <vulkan/vulkan.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "instance.h"
#include "memory.h"
#include "pipelines.h"
#include "stream.h"

namespace helios_vk {

// One buffer argument of a dispatch: binding i is (handle, offset, nbytes).
struct BufArg {
  uint64_t handle;
  uint64_t offset;
  uint64_t nbytes;
  bool write;
};

class Device {
 public:
  Device(int index, const std::string& pipeline_cache_dir);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const PhysicalDeviceInfo& info() const { return info_; }
  bool closed() const { return dev_ == VK_NULL_HANDLE; }
  void close();

  // Memory.
  uint64_t alloc(uint64_t nbytes, int pool);
  void free(uint64_t handle);
  uint64_t size_of(uint64_t handle);
  void location(uint64_t handle, uint32_t& block_id, uint64_t& offset);
  const PoolStats& pool_stats(int pool) { ensure_open(); return alloc_->stats(pool); }
  uint64_t block_size() { ensure_open(); return alloc_->block_size(); }

  // Host transfers.
  void write(uint64_t handle, uint64_t offset, const void* data, uint64_t n);
  void read(uint64_t handle, uint64_t offset, void* out, uint64_t n);
  // Zero-copy host access where the allocation's memory is host-visible: the address of
  // [offset, offset+n) after waiting for recorded work that writes it (for_write: that
  // touches it at all), or nullptr when the memory is not mapped (discrete GPUs).
  uint8_t* map(uint64_t handle, uint64_t offset, uint64_t n, bool for_write);
  // Whether no unfinished work writes (for_write: touches) the range; never waits, but
  // submits the open command buffer when it holds that work, so polling makes progress.
  bool ready(uint64_t handle, uint64_t offset, uint64_t n, bool for_write);
  // The host wrote [offset, offset+n) through map(): make it visible to the device.
  void host_wrote(uint64_t handle, uint64_t offset, uint64_t n);
  void copy(uint64_t src, uint64_t src_offset, uint64_t dst, uint64_t dst_offset, uint64_t nbytes);
  void fill(uint64_t handle, uint64_t offset, uint64_t nbytes, uint32_t value);

  // Pipelines and dispatch.
  // subgroup_size > 0: the pipeline runs in full subgroups of exactly that many invocations
  // (Vulkan 1.3's required subgroup size; ArgError where the device cannot require it).
  uint32_t pipeline(const uint8_t* spirv, size_t n, uint32_t num_buffers, uint32_t push_size,
                    const std::vector<uint32_t>& spec, const std::string& name, uint32_t subgroup_size = 0);
  void save_pipeline_cache();
  std::string pipeline_cache_path() const { return pipelines_ ? pipelines_->cache_path() : ""; }
  bool pipeline_cache_loaded() const { return pipelines_ && pipelines_->cache_loaded(); }
  void dispatch(uint64_t pipeline, const BufArg* bufs, size_t nbufs, const void* push, size_t push_n,
                const uint32_t groups[3], uint32_t name_id, uint64_t flops, uint64_t nbytes);
  double bench_raw_dispatch(uint64_t pipeline, const std::vector<BufArg>& bufs, const std::string& push,
                            const uint32_t groups[3], uint64_t n);

  // Stream control.
  void flush();
  void synchronize();
  StreamStats stats();
  uint64_t pending_ops();
  void reset_stats();
  uint32_t auto_submit();
  void set_auto_submit(uint32_t n);

  // Profiling.
  void set_profiling(bool on);
  bool profiling();
  void take_events(std::vector<Event>& events, std::vector<SubmitRecord>& submits);

  // Marks (stream.h): device timestamps at points of the stream, resolved without waiting.
  bool marks_supported() { ensure_open(); return stream_->marks_supported(); }
  uint64_t mark() { ensure_open(); return stream_->mark(); }
  void wait_mark(uint64_t id) { ensure_open(); stream_->wait_mark(id); }
  std::vector<Mark> take_marks() { ensure_open(); return stream_->take_marks(); }

  // Op names are interned once: events and errors carry a small id.
  uint32_t intern(const std::string& name);
  const std::string& name_of(uint32_t id) const { return names_[id]; }

 private:
  void ensure_open() const {
    if (dev_ == VK_NULL_HANDLE) throw std::runtime_error("this Device is closed; create a new helios._vulkan.Device");
  }
  Allocation& lookup(uint64_t handle, const char* op, uint32_t name_id);
  // The rgba32f (or, with uint_texels, rgba32ui) view of [offset, offset + nbytes) of block's buffer
  // for a uniform texel buffer binding (made once per range and format, owned by the block).
  VkBufferView texel_view(Block& block, uint64_t offset, uint64_t nbytes, bool uint_texels, const char* opname,
                          size_t binding);
  void check_range(const Allocation& a, uint64_t handle, uint64_t offset, uint64_t n, const char* op) const;
  void record_copy(Block* src, uint64_t src_abs, Block* dst, uint64_t dst_abs, uint64_t n, uint32_t name_id);
  void staged_write(Block* dst, uint64_t dst_abs, const uint8_t* data, uint64_t n);
  void staged_read(Block* src, uint64_t src_abs, uint8_t* out, uint64_t n);
  void destroy();

  std::shared_ptr<Instance> instance_;
  PhysicalDeviceInfo info_;
  VkDevice dev_ = VK_NULL_HANDLE;
  VkQueue queue_ = VK_NULL_HANDLE;
  PFN_vkCmdPushDescriptorSetKHR push_descriptor_ = nullptr;
  std::unique_ptr<Allocator> alloc_;
  std::unique_ptr<Pipelines> pipelines_;
  std::unique_ptr<Stream> stream_;

  std::vector<std::string> names_;
  std::unordered_map<std::string, uint32_t> name_ids_;
  uint32_t copy_name_ = 0, fill_name_ = 0, upload_name_ = 0, download_name_ = 0, bench_name_ = 0;
};

}  // namespace helios_vk
