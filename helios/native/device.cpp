// Logical device creation, argument validation, host transfers and op recording.
#include "device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "vk_util.h"

namespace helios_vk {

namespace {

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0;
}

// Staging transfers move at most this much per submit, so a huge tensor does
// not need a staging buffer as big as itself.
constexpr uint64_t kStagingChunk = 16ull << 20;

}  // namespace

Device::Device(int index, const std::string& pipeline_cache_dir) {
  instance_ = get_instance();
  if (!instance_) throw std::runtime_error("no Vulkan device: " + last_error());
  if (index < 0 || size_t(index) >= instance_->devices.size())
    throw ArgError(strf("Device(%d): index out of range; enumerate_devices() lists %zu device(s), indices 0..%zu", index,
                        instance_->devices.size(), instance_->devices.size() - 1));
  info_ = instance_->devices[index];
  if (info_.api_version < VK_API_VERSION_1_1)
    throw std::runtime_error("device '" + info_.name + "' supports only Vulkan " + version_string(info_.api_version) +
                             "; Helios needs 1.1 or newer");
  // Test switches that exercise the paths of other hardware on this one.
  if (env_flag("HELIOS_VK_NO_PUSH_DESCRIPTOR")) info_.push_descriptor = false;
  if (env_flag("HELIOS_VK_NO_CALIBRATED_TIMESTAMPS")) info_.calibrated_timestamps = false;
  if (env_flag("HELIOS_VK_NO_TIMELINE_SEMAPHORE")) info_.timeline_semaphore = false;
  const bool force_staging = env_flag("HELIOS_VK_FORCE_STAGING");
  uint64_t block_size = 64ull << 20;
  if (const char* mb = std::getenv("HELIOS_VK_BLOCK_MB")) block_size = std::max(1ull, std::strtoull(mb, nullptr, 10)) << 20;
  uint64_t budget = 0;  // HELIOS_VK_MEMORY_LIMIT_MB: cap what this Device reserves (shared GPUs, OOM tests)
  if (const char* mb = std::getenv("HELIOS_VK_MEMORY_LIMIT_MB")) budget = std::strtoull(mb, nullptr, 10) << 20;

  const bool v12 = std::min(info_.api_version, instance_->api_version) >= VK_API_VERSION_1_2;
  std::vector<const char*> exts;
  if (info_.push_descriptor) exts.push_back(VK_KHR_PUSH_DESCRIPTOR_EXTENSION_NAME);
  if (info_.calibrated_timestamps) exts.push_back(VK_EXT_CALIBRATED_TIMESTAMPS_EXTENSION_NAME);
  if (!v12 && info_.storage8 && info_.has_ext_8bit_storage) exts.push_back(VK_KHR_8BIT_STORAGE_EXTENSION_NAME);
  if (!v12 && (info_.float16 || info_.int8) && info_.has_ext_float16_int8)
    exts.push_back(VK_KHR_SHADER_FLOAT16_INT8_EXTENSION_NAME);
  if (!info_.coopmat.empty()) exts.push_back(kCoopMatExtension);  // listed only where it can be enabled
  if (info_.bf16_coopmat) exts.push_back(kBf16Extension);

  // Enable exactly the features the device has (enabling a missing one fails creation).
  VkPhysicalDeviceFeatures2 f2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
  VkPhysicalDevice16BitStorageFeatures s16{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES};
  VkPhysicalDevice8BitStorageFeatures s8{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_8BIT_STORAGE_FEATURES};
  VkPhysicalDeviceShaderFloat16Int8Features f16{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES};
  VkPhysicalDeviceTimelineSemaphoreFeatures timeline{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_TIMELINE_SEMAPHORE_FEATURES};
  timeline.timelineSemaphore = VK_TRUE;
  VkPhysicalDeviceVulkanMemoryModelFeatures vmm{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_MEMORY_MODEL_FEATURES};
  vmm.vulkanMemoryModel = VK_TRUE;  // the cooperative-matrix kernels' SPIR-V uses the Vulkan memory model
  CoopMatFeaturesKHR coop;
  coop.cooperativeMatrix = VK_TRUE;
  Bf16FeaturesKHR bf16;  // the bf16 cooperative-matrix kernels: bfloat16 values and cooperative matrices of them
  bf16.shaderBFloat16Type = VK_TRUE;
  bf16.shaderBFloat16CooperativeMatrix = VK_TRUE;
  VkPhysicalDeviceSubgroupSizeControlFeatures sgctl{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_FEATURES};
  sgctl.subgroupSizeControl = VK_TRUE;  // only chained where the device has it (describe(): min_subgroup_size > 0)
  sgctl.computeFullSubgroups = info_.compute_full_subgroups;
  f2.features.shaderInt64 = info_.int64;
  f2.features.shaderInt16 = info_.int16;
  s16.storageBuffer16BitAccess = info_.storage16;
  s8.storageBuffer8BitAccess = info_.storage8;
  f16.shaderFloat16 = info_.float16;
  f16.shaderInt8 = info_.int8;
  void** tail = &f2.pNext;
  *tail = &s16, tail = &s16.pNext;
  if (info_.storage8) *tail = &s8, tail = &s8.pNext;
  if (info_.float16 || info_.int8) *tail = &f16, tail = &f16.pNext;
  if (info_.timeline_semaphore && v12) *tail = &timeline, tail = &timeline.pNext;
  else info_.timeline_semaphore = false;
  if (!info_.coopmat.empty()) *tail = &vmm, tail = &vmm.pNext, *tail = &coop, tail = &coop.pNext;
  if (info_.bf16_coopmat) *tail = &bf16, tail = &bf16.pNext;
  if (info_.min_subgroup_size > 0) *tail = &sgctl, tail = &sgctl.pNext;

  float priority = 1.0f;
  VkDeviceQueueCreateInfo qci{VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO};
  qci.queueFamilyIndex = info_.queue_family;
  qci.queueCount = 1;
  qci.pQueuePriorities = &priority;
  VkDeviceCreateInfo dci{VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO};
  dci.pNext = &f2;
  dci.queueCreateInfoCount = 1;
  dci.pQueueCreateInfos = &qci;
  dci.enabledExtensionCount = uint32_t(exts.size());
  dci.ppEnabledExtensionNames = exts.data();
  check(vkCreateDevice(info_.handle, &dci, nullptr, &dev_), "vkCreateDevice");
  vkGetDeviceQueue(dev_, info_.queue_family, 0, &queue_);
  if (info_.push_descriptor) {
    push_descriptor_ = reinterpret_cast<PFN_vkCmdPushDescriptorSetKHR>(vkGetDeviceProcAddr(dev_, "vkCmdPushDescriptorSetKHR"));
    if (!push_descriptor_) info_.push_descriptor = false;
  }

  try {
    alloc_ = std::make_unique<Allocator>(dev_, info_, force_staging, block_size, budget);
    pipelines_ = std::make_unique<Pipelines>(dev_, info_, info_.push_descriptor, pipeline_cache_dir);
    stream_ = std::make_unique<Stream>(dev_, queue_, info_, info_.calibrated_timestamps,
                                       [this](uint64_t done) { alloc_->reclaim(done); });
  } catch (...) {
    destroy();
    throw;
  }
  intern("");
  copy_name_ = intern("copy");
  fill_name_ = intern("fill");
  upload_name_ = intern("upload");
  download_name_ = intern("download");
  bench_name_ = intern("bench_raw_dispatch");
}

Device::~Device() {
  try {
    close();
  } catch (...) {
    // A destructor must not throw; close() already released everything.
  }
}

void Device::destroy() {
  stream_.reset();
  pipelines_.reset();
  alloc_.reset();
  if (dev_) vkDestroyDevice(dev_, nullptr);
  dev_ = VK_NULL_HANDLE;
  instance_.reset();
}

void Device::close() {
  if (dev_ == VK_NULL_HANDLE) return;
  std::exception_ptr err;
  try {
    stream_->synchronize();
  } catch (...) {
    err = std::current_exception();
  }
  vkDeviceWaitIdle(dev_);  // also covers a failed synchronize (device lost): nothing may run while we destroy
  try {
    pipelines_->save_cache();
  } catch (...) {
    if (!err) err = std::current_exception();
  }
  destroy();
  if (err) std::rethrow_exception(err);
}

uint32_t Device::intern(const std::string& name) {
  auto it = name_ids_.find(name);
  if (it != name_ids_.end()) return it->second;
  uint32_t id = uint32_t(names_.size());
  names_.push_back(name);
  name_ids_.emplace(name, id);
  return id;
}

// ---------------------------------------------------------------- memory

uint64_t Device::alloc(uint64_t nbytes, int pool) {
  ensure_open();
  if (pool < 0 || pool >= kNumPools) throw ArgError("alloc: pool must be 'weights', 'activations' or 'staging'");
  // Retiring finished work reclaims its frees; only worth a fence query when the
  // oldest deferred free waits on a submission that is already on the queue.
  uint64_t oldest = alloc_->oldest_pending_serial();
  if (oldest > stream_->completed_serial() && oldest <= stream_->submitted_serial()) stream_->poll();
  uint64_t h = alloc_->try_alloc(nbytes, pool);
  if (h) return h;
  // Out of memory: wait for everything, take back every deferred free, release
  // empty blocks, and try once more before giving up.
  stream_->synchronize();
  alloc_->reclaim(stream_->completed_serial());
  alloc_->trim();
  h = alloc_->try_alloc(nbytes, pool);
  if (h) return h;
  std::string cap = alloc_->budget() ? strf(" (HELIOS_VK_MEMORY_LIMIT_MB caps this Device at %llu bytes)",
                                            (unsigned long long)alloc_->budget())
                                     : std::string();
  throw OutOfMemory(strf("out of device memory: asked %llu bytes in pool '%s' on '%s'%s; the allocation failed after "
                         "synchronizing and releasing free blocks. Pools: %s. Free tensors you no longer need or use "
                         "smaller batches.",
                         (unsigned long long)nbytes, pool_name(pool), info_.name.c_str(), cap.c_str(),
                         alloc_->pools_summary().c_str()));
}

void Device::free(uint64_t handle) {
  ensure_open();
  alloc_->free(handle, stream_->current_serial());
  alloc_->reclaim(stream_->completed_serial());  // nothing pending touched it: reusable at once
}

uint64_t Device::size_of(uint64_t handle) {
  ensure_open();
  return alloc_->get(handle).size;
}

void Device::location(uint64_t handle, uint32_t& block_id, uint64_t& offset) {
  ensure_open();
  Allocation& a = alloc_->get(handle);
  block_id = a.block->id;
  offset = a.offset;
}

Allocation& Device::lookup(uint64_t handle, const char* op, uint32_t name_id) {
  try {
    return alloc_->get(handle);
  } catch (const ArgError& e) {
    if (name_id) throw ArgError(strf("%s '%s': %s", op, names_[name_id].c_str(), e.what()));
    throw ArgError(strf("%s: %s", op, e.what()));
  }
}

void Device::check_range(const Allocation& a, uint64_t handle, uint64_t offset, uint64_t n, const char* op) const {
  if (offset > a.size || n > a.size - offset)
    throw ArgError(strf("%s: range [%llu, %llu) is outside the %llu-byte allocation of handle %llu", op,
                        (unsigned long long)offset, (unsigned long long)(offset + n), (unsigned long long)a.size,
                        (unsigned long long)handle));
}

// ---------------------------------------------------------------- transfers

void Device::write(uint64_t handle, uint64_t offset, const void* data, uint64_t n) {
  ensure_open();
  Allocation& a = lookup(handle, "write", 0);
  check_range(a, handle, offset, n, "write");
  if (n == 0) return;
  Block* b = a.block;
  if (!b->mapped) return staged_write(b, a.offset + offset, static_cast<const uint8_t*>(data), n);
  uint64_t abs = a.offset + offset;
  // Writing over a range that recorded or running work reads or writes would
  // change its inputs: let that work finish first.  Otherwise no wait at all.
  if (uint64_t s = stream_->unfinished_access(b, abs, abs + n, false)) stream_->wait_serial(s);
  std::memcpy(b->mapped + abs, data, n);
  alloc_->flush(b, abs, n);
}

void Device::read(uint64_t handle, uint64_t offset, void* out, uint64_t n) {
  ensure_open();
  Allocation& a = lookup(handle, "read", 0);
  check_range(a, handle, offset, n, "read");
  if (n == 0) return;
  Block* b = a.block;
  if (!b->mapped) return staged_read(b, a.offset + offset, static_cast<uint8_t*>(out), n);
  uint64_t abs = a.offset + offset;
  // Submit on readback: only pending writes to this range force a wait.
  if (uint64_t s = stream_->unfinished_access(b, abs, abs + n, true)) stream_->wait_serial(s);
  alloc_->invalidate(b, abs, n);
  std::memcpy(out, b->mapped + abs, n);
}

uint8_t* Device::map(uint64_t handle, uint64_t offset, uint64_t n, bool for_write) {
  ensure_open();
  Allocation& a = lookup(handle, "map", 0);
  check_range(a, handle, offset, n, "map");
  Block* b = a.block;
  if (!b->mapped) return nullptr;
  uint64_t abs = a.offset + offset;
  if (n) {
    if (uint64_t s = stream_->unfinished_access(b, abs, abs + n, !for_write)) stream_->wait_serial(s);
    alloc_->invalidate(b, abs, n);
  }
  return b->mapped + abs;
}

bool Device::ready(uint64_t handle, uint64_t offset, uint64_t n, bool for_write) {
  ensure_open();
  Allocation& a = lookup(handle, "ready", 0);
  check_range(a, handle, offset, n, "ready");
  uint64_t abs = a.offset + offset;
  uint64_t s = stream_->unfinished_access(a.block, abs, abs + n, !for_write);
  if (s == 0) return true;
  if (s > stream_->submitted_serial()) stream_->flush();  // still recorded only: submit it
  return false;
}

void Device::host_wrote(uint64_t handle, uint64_t offset, uint64_t n) {
  ensure_open();
  Allocation& a = lookup(handle, "host_wrote", 0);
  check_range(a, handle, offset, n, "host_wrote");
  if (a.block->mapped && n) alloc_->flush(a.block, a.offset + offset, n);
}

void Device::record_copy(Block* src, uint64_t src_abs, Block* dst, uint64_t dst_abs, uint64_t n, uint32_t name_id) {
  Use uses[2] = {{src, src_abs, src_abs + n, false}, {dst, dst_abs, dst_abs + n, true}};
  uint64_t t = stream_->profiling() ? monotonic_ns() : 0;
  VkCommandBuffer cmd = stream_->begin_op(uses, 2);
  uint32_t q = stream_->ts_begin(name_id, 0, 2 * n, t);
  VkBufferCopy region{src_abs, dst_abs, n};
  vkCmdCopyBuffer(cmd, src->buffer, dst->buffer, 1, &region);
  stream_->end_op(q, false, true);
}

void Device::staged_write(Block* dst, uint64_t dst_abs, const uint8_t* data, uint64_t n) {
  // Discrete GPUs: host -> staging (mapped) -> recorded copy -> wait.
  // (Takes the block, not an Allocation&: alloc() below may grow the slot table.)
  uint64_t chunk = std::min(n, kStagingChunk);
  uint64_t sh = alloc(chunk, kStaging);
  try {
    Allocation& s = alloc_->get(sh);
    for (uint64_t done = 0; done < n; done += chunk) {
      uint64_t k = std::min(chunk, n - done);
      // The staging range is fresh or was waited for in the previous round.
      std::memcpy(s.block->mapped + s.offset, data + done, k);
      alloc_->flush(s.block, s.offset, k);
      record_copy(s.block, s.offset, dst, dst_abs + done, k, upload_name_);
      stream_->wait_serial(stream_->current_serial());
    }
  } catch (...) {
    alloc_->free(sh, stream_->current_serial());
    throw;
  }
  alloc_->free(sh, stream_->current_serial());
}

void Device::staged_read(Block* src, uint64_t src_abs, uint8_t* out, uint64_t n) {
  uint64_t chunk = std::min(n, kStagingChunk);
  uint64_t sh = alloc(chunk, kStaging);
  try {
    Allocation& s = alloc_->get(sh);
    for (uint64_t done = 0; done < n; done += chunk) {
      uint64_t k = std::min(chunk, n - done);
      record_copy(src, src_abs + done, s.block, s.offset, k, download_name_);
      stream_->wait_serial(stream_->current_serial());
      alloc_->invalidate(s.block, s.offset, k);
      std::memcpy(out + done, s.block->mapped + s.offset, k);
    }
  } catch (...) {
    alloc_->free(sh, stream_->current_serial());
    throw;
  }
  alloc_->free(sh, stream_->current_serial());
}

void Device::copy(uint64_t src, uint64_t src_offset, uint64_t dst, uint64_t dst_offset, uint64_t nbytes) {
  ensure_open();
  Allocation& s = lookup(src, "copy (src)", 0);
  Allocation& d = lookup(dst, "copy (dst)", 0);
  check_range(s, src, src_offset, nbytes, "copy (src)");
  check_range(d, dst, dst_offset, nbytes, "copy (dst)");
  if (nbytes == 0) return;
  uint64_t sa = s.offset + src_offset, da = d.offset + dst_offset;
  if (s.block == d.block && sa < da + nbytes && da < sa + nbytes)
    throw ArgError(strf("copy: source [%llu, %llu) and destination [%llu, %llu) overlap; vkCmdCopyBuffer needs disjoint "
                        "ranges (copy through a temporary)",
                        (unsigned long long)src_offset, (unsigned long long)(src_offset + nbytes),
                        (unsigned long long)dst_offset, (unsigned long long)(dst_offset + nbytes)));
  record_copy(s.block, sa, d.block, da, nbytes, copy_name_);
}

void Device::fill(uint64_t handle, uint64_t offset, uint64_t nbytes, uint32_t value) {
  ensure_open();
  Allocation& a = lookup(handle, "fill", 0);
  if (offset % 4 || nbytes % 4)
    throw ArgError(strf("fill: offset (%llu) and nbytes (%llu) must be multiples of 4 (vkCmdFillBuffer writes 32-bit words)",
                        (unsigned long long)offset, (unsigned long long)nbytes));
  check_range(a, handle, offset, nbytes, "fill");
  if (nbytes == 0) return;
  uint64_t abs = a.offset + offset;
  Use use{a.block, abs, abs + nbytes, true};
  uint64_t t = stream_->profiling() ? monotonic_ns() : 0;
  VkCommandBuffer cmd = stream_->begin_op(&use, 1);
  uint32_t q = stream_->ts_begin(fill_name_, 0, nbytes, t);
  vkCmdFillBuffer(cmd, a.block->buffer, abs, nbytes, value);
  stream_->end_op(q, false, false);
}

// ---------------------------------------------------------------- pipelines and dispatch

uint32_t Device::pipeline(const uint8_t* spirv, size_t n, uint32_t num_buffers, uint32_t push_size,
                          const std::vector<uint32_t>& spec, const std::string& name, uint32_t subgroup_size) {
  ensure_open();
  return pipelines_->get_or_create(spirv, n, num_buffers, push_size, spec, name, subgroup_size);
}

void Device::save_pipeline_cache() {
  ensure_open();
  pipelines_->save_cache();
}

VkBufferView Device::texel_view(Block& block, uint64_t offset, uint64_t nbytes, bool uint_texels, const char* opname,
                                size_t binding) {
  // The range is rounded up to whole 16-byte texels (a tensor's last elements may end inside
  // one); blocks are multiples of 256 bytes, so the rounded range stays inside the block.
  uint64_t range = std::min<uint64_t>((nbytes + 15) & ~uint64_t(15), (block.size - offset) & ~uint64_t(15));
  auto key = std::make_tuple(offset, range, uint_texels);
  auto it = block.texel_views.find(key);
  if (it != block.texel_views.end()) return it->second;
  uint64_t align = std::max<uint64_t>(1, info_.min_texel_buffer_offset_alignment);
  if (offset % align)
    throw ArgError(strf("dispatch '%s': buffer %zu is a texel buffer at offset %llu, not a multiple of "
                        "minTexelBufferOffsetAlignment %llu", opname, binding, (unsigned long long)offset,
                        (unsigned long long)align));
  if (range / 16 > info_.max_texel_buffer_elements)
    throw ArgError(strf("dispatch '%s': buffer %zu binds %llu texels as a texel buffer, above maxTexelBufferElements %llu",
                        opname, binding, (unsigned long long)(range / 16), (unsigned long long)info_.max_texel_buffer_elements));
  VkBufferViewCreateInfo ci{VK_STRUCTURE_TYPE_BUFFER_VIEW_CREATE_INFO};
  ci.buffer = block.buffer;
  ci.format = uint_texels ? VK_FORMAT_R32G32B32A32_UINT : VK_FORMAT_R32G32B32A32_SFLOAT;
  ci.offset = offset;
  ci.range = range;
  VkBufferView view;
  check(vkCreateBufferView(dev_, &ci, nullptr, &view), "vkCreateBufferView");
  block.texel_views[key] = view;
  return view;
}

void Device::dispatch(uint64_t pipeline, const BufArg* bufs, size_t nbufs, const void* push, size_t push_n,
                      const uint32_t groups[3], uint32_t name_id, uint64_t flops, uint64_t nbytes) {
  ensure_open();
  const char* opname = names_[name_id].c_str();
  const Pipeline* p = pipelines_->find(pipeline);
  if (!p) throw ArgError(strf("dispatch '%s': unknown pipeline id %llu", opname, (unsigned long long)pipeline));
  if (nbufs != p->num_buffers)
    throw ArgError(strf("dispatch '%s': pipeline '%s' takes %u buffers, got %zu", opname, p->name.c_str(), p->num_buffers,
                        nbufs));
  if (push_n != p->push_size)
    throw ArgError(strf("dispatch '%s': push constants are %zu bytes, pipeline '%s' expects %u", opname, push_n,
                        p->name.c_str(), p->push_size));
  for (int i = 0; i < 3; ++i)
    if (groups[i] > info_.max_workgroup_count[i])
      throw ArgError(strf("dispatch '%s': groups[%d] = %u exceeds maxComputeWorkGroupCount[%d] = %u; split the dispatch",
                          opname, i, groups[i], i, info_.max_workgroup_count[i]));

  Use uses[Pipelines::kMaxBuffers];
  VkDescriptorBufferInfo infos[Pipelines::kMaxBuffers];
  VkBufferView views[Pipelines::kMaxBuffers];
  const uint64_t align = info_.min_storage_buffer_offset_alignment;
  for (size_t i = 0; i < nbufs; ++i) {
    const BufArg& ba = bufs[i];
    Allocation& a = lookup(ba.handle, "dispatch", name_id);
    if (align > 1 && ba.offset % align)
      throw ArgError(strf("dispatch '%s': buffer %zu offset %llu is not a multiple of minStorageBufferOffsetAlignment %llu",
                          opname, i, (unsigned long long)ba.offset, (unsigned long long)align));
    if (ba.nbytes > info_.max_storage_buffer_range)
      throw ArgError(strf("dispatch '%s': buffer %zu binds %llu bytes, above maxStorageBufferRange %llu; bind a window",
                          opname, i, (unsigned long long)ba.nbytes, (unsigned long long)info_.max_storage_buffer_range));
    if (ba.offset > a.size || ba.nbytes > a.size - ba.offset)
      throw ArgError(strf("dispatch '%s': buffer %zu range [%llu, %llu) is outside its %llu-byte allocation", opname, i,
                          (unsigned long long)ba.offset, (unsigned long long)(ba.offset + ba.nbytes),
                          (unsigned long long)a.size));
    uint64_t abs = a.offset + ba.offset;
    uses[i] = {a.block, abs, abs + ba.nbytes, ba.write};
    // An empty binding still needs a valid range: bind the allocation's first
    // bytes (rounded allocations are at least 256 bytes); nothing is accessed.
    infos[i] = ba.nbytes ? VkDescriptorBufferInfo{a.block->buffer, abs, ba.nbytes}
                         : VkDescriptorBufferInfo{a.block->buffer, a.offset, std::min<uint64_t>(a.rounded, 16)};
    if ((p->texel_mask >> i) & 1)
      views[i] = texel_view(*a.block, infos[i].offset, infos[i].range, (p->texel_uint_mask >> i) & 1, opname, i);
  }
  if (groups[0] == 0 || groups[1] == 0 || groups[2] == 0) return;  // empty tensor: nothing to run

  uint64_t t = stream_->profiling() ? monotonic_ns() : 0;
  VkCommandBuffer cmd = stream_->begin_op(uses, nbufs);
  uint32_t q = stream_->ts_begin(name_id, flops, nbytes, t);
  stream_->bind_pipeline(cmd, p->pipeline);
  if (nbufs) {
    VkWriteDescriptorSet writes[Pipelines::kMaxBuffers];
    for (size_t i = 0; i < nbufs; ++i) {
      writes[i] = VkWriteDescriptorSet{VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET};
      writes[i].dstBinding = uint32_t(i);
      writes[i].descriptorCount = 1;
      if ((p->texel_mask >> i) & 1) {
        writes[i].descriptorType = VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER;
        writes[i].pTexelBufferView = &views[i];
      } else {
        writes[i].descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER;
        writes[i].pBufferInfo = &infos[i];
      }
    }
    if (p->push_descriptor) {
      push_descriptor_(cmd, VK_PIPELINE_BIND_POINT_COMPUTE, p->layout, 0, uint32_t(nbufs), writes);
    } else {
      VkDescriptorSet set = stream_->alloc_descriptor_set(p->set_layout);
      for (size_t i = 0; i < nbufs; ++i) writes[i].dstSet = set;
      vkUpdateDescriptorSets(dev_, uint32_t(nbufs), writes, 0, nullptr);
      vkCmdBindDescriptorSets(cmd, VK_PIPELINE_BIND_POINT_COMPUTE, p->layout, 0, 1, &set, 0, nullptr);
    }
  }
  if (push_n) vkCmdPushConstants(cmd, p->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, uint32_t(push_n), push);
  vkCmdDispatch(cmd, groups[0], groups[1], groups[2]);
  stream_->end_op(q, true, false);
}

double Device::bench_raw_dispatch(uint64_t pipeline, const std::vector<BufArg>& bufs, const std::string& push,
                                  const uint32_t groups[3], uint64_t n) {
  ensure_open();
  uint64_t t0 = monotonic_ns();
  for (uint64_t i = 0; i < n; ++i)
    dispatch(pipeline, bufs.data(), bufs.size(), push.data(), push.size(), groups, bench_name_, 0, 0);
  stream_->synchronize();
  return double(monotonic_ns() - t0) * 1e-9;
}

// ---------------------------------------------------------------- stream control

void Device::flush() {
  ensure_open();
  stream_->flush();
}

void Device::synchronize() {
  ensure_open();
  stream_->synchronize();
}

StreamStats Device::stats() {
  ensure_open();
  return stream_->stats();
}

uint64_t Device::pending_ops() {
  ensure_open();
  return stream_->pending_ops();
}

void Device::reset_stats() {
  ensure_open();
  stream_->reset_stats();
}

uint32_t Device::auto_submit() {
  ensure_open();
  return stream_->auto_submit();
}

void Device::set_auto_submit(uint32_t n) {
  ensure_open();
  if (n == 0) throw ArgError("auto_submit_dispatches must be >= 1");
  stream_->set_auto_submit(n);
}

void Device::set_profiling(bool on) {
  ensure_open();
  stream_->set_profiling(on);
}

bool Device::profiling() {
  ensure_open();
  return stream_->profiling();
}

void Device::take_events(std::vector<Event>& events, std::vector<SubmitRecord>& submits) {
  ensure_open();
  events = stream_->take_events();
  submits = stream_->take_submits();
}

}  // namespace helios_vk
