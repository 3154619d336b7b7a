// Command stream: ring of command buffers, hazard barriers, submits, timestamps.
//
// Submission model: ops record into the open command buffer and return; the
// buffer is submitted when it holds auto_submit ops, on flush/synchronize, or
// when the host needs a result.  A ring of kRing buffers lets the host record
// the next batch while the device runs earlier ones; the host waits (on the timeline
// semaphore every submission signals with its serial, or on a fence per buffer where
// the device has no timeline semaphores) only when the ring is full or when it needs data.
#include "stream.h"

#include <algorithm>

#include "vk_util.h"

namespace helios_vk {

namespace {
constexpr VkPipelineStageFlags kWorkStages = VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT;
constexpr VkAccessFlags kWrites = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT;
constexpr VkAccessFlags kAll = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_READ_BIT |
                               VK_ACCESS_TRANSFER_WRITE_BIT;
constexpr uint32_t kDescSetsPerPool = 256;
}  // namespace

Stream::Stream(VkDevice dev, VkQueue queue, const PhysicalDeviceInfo& info, bool calibrated,
               std::function<void(uint64_t)> on_complete)
    : dev_(dev), queue_(queue), info_(info), calibrated_(calibrated), on_complete_(std::move(on_complete)) {
  ts_mask_ = info.timestamp_valid_bits >= 64 ? ~0ull : ((1ull << info.timestamp_valid_bits) - 1);
  if (calibrated_) {
    get_calibrated_ =
        reinterpret_cast<PFN_vkGetCalibratedTimestampsEXT>(vkGetDeviceProcAddr(dev_, "vkGetCalibratedTimestampsEXT"));
    calibrated_ = get_calibrated_ != nullptr;
  }
  for (auto& s : slots_) {
    VkCommandPoolCreateInfo pci{VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO};
    // One pool per slot: resetting the whole pool is cheaper than per-buffer resets.
    pci.flags = VK_COMMAND_POOL_CREATE_TRANSIENT_BIT;
    pci.queueFamilyIndex = info.queue_family;
    check(vkCreateCommandPool(dev_, &pci, nullptr, &s.pool), "vkCreateCommandPool");
    VkCommandBufferAllocateInfo ai{VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO};
    ai.commandPool = s.pool;
    ai.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
    ai.commandBufferCount = 1;
    check(vkAllocateCommandBuffers(dev_, &ai, &s.cmd), "vkAllocateCommandBuffers");
    if (!info.timeline_semaphore) {
      VkFenceCreateInfo fci{VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
      check(vkCreateFence(dev_, &fci, nullptr, &s.fence), "vkCreateFence");
    }
  }
  if (info.timeline_semaphore) {
    VkSemaphoreTypeCreateInfo ti{VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO};
    ti.semaphoreType = VK_SEMAPHORE_TYPE_TIMELINE;
    ti.initialValue = 0;  // serials start at 1
    VkSemaphoreCreateInfo ci{VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO};
    ci.pNext = &ti;
    check(vkCreateSemaphore(dev_, &ci, nullptr, &timeline_), "vkCreateSemaphore");
  }
}

Stream::~Stream() {
  // The owner waits for the device to be idle before destroying the stream.
  for (auto& s : slots_) {
    for (auto p : s.desc_pools) vkDestroyDescriptorPool(dev_, p, nullptr);
    if (s.queries) vkDestroyQueryPool(dev_, s.queries, nullptr);
    if (s.mark_queries) vkDestroyQueryPool(dev_, s.mark_queries, nullptr);
    if (s.fence) vkDestroyFence(dev_, s.fence, nullptr);
    if (s.pool) vkDestroyCommandPool(dev_, s.pool, nullptr);
  }
  if (timeline_) vkDestroySemaphore(dev_, timeline_, nullptr);
}

void Stream::record_barrier(VkCommandBuffer cmd) {
  // One global memory barrier: cheaper than per-buffer barriers on every driver
  // we know of, and a full pipeline barrier costs twice as much (ggml #8943).
  VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
  mb.srcAccessMask = kWrites;
  mb.dstAccessMask = kAll;
  vkCmdPipelineBarrier(cmd, kWorkStages, kWorkStages, 0, 1, &mb, 0, nullptr, 0, nullptr);
}

void Stream::open_slot() {
  Slot& s = slots_[next_];
  if (s.state == Slot::kInFlight) {
    // Ring full: the oldest submission must finish before its buffer is reused.
    wait_serial(s.serial);
  }
  check(vkResetCommandPool(dev_, s.pool, 0), "vkResetCommandPool");
  for (auto p : s.desc_pools) check(vkResetDescriptorPool(dev_, p, 0), "vkResetDescriptorPool");
  s.desc_cur = 0;
  VkCommandBufferBeginInfo bi{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
  bi.flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT;
  check(vkBeginCommandBuffer(s.cmd, &bi), "vkBeginCommandBuffer");
  s.state = Slot::kRecording;
  s.serial = next_serial_++;
  last_serial_ = s.serial;
  s.ops = s.dispatches = 0;
  s.wrote = false;
  s.bound = VK_NULL_HANDLE;
  s.accesses.clear();
  s.events.clear();
  s.queries_used = 0;
  s.queries_reset = false;
  s.marks_reset = false;
  s.mark_ids.clear();
  s.calibrated = false;
  open_ = next_;
  next_ = (next_ + 1) % kRing;
  if (entry_barrier_) {
    // Hazard sets were dropped at the last full wait; a fence wait makes earlier
    // writes available but not visible to later commands, so order once here.
    record_barrier(s.cmd);
    entry_barrier_ = false;
  }
}

VkCommandBuffer Stream::begin_op(const Use* uses, size_t n) {
  if (open_ < 0) open_slot();
  Slot* s = &slots_[open_];
  if (profiling_ && s->queries_used + 2 > s->query_capacity && s->queries_used > 0) {
    // The query pool is full: start a new buffer rather than lose timestamps.
    submit_open();
    open_slot();
    s = &slots_[open_];
  }
  bool need = false;
  for (size_t i = 0; i < n && !need; ++i)
    need = hazards_.conflicts(uses[i].block->hazards, uses[i].begin, uses[i].end, uses[i].write);
  if (need) {
    record_barrier(s->cmd);
    hazards_.clear();
    stats_.barriers += 1;
  }
  for (size_t i = 0; i < n; ++i) {
    const Use& u = uses[i];
    if (u.begin >= u.end) continue;
    hazards_.record(u.block->hazards, u.begin, u.end, u.write);
    u.block->last_serial = s->serial;
    s->accesses.push_back(u);
    s->wrote |= u.write;
  }
  return s->cmd;
}

void Stream::ensure_queries(Slot& s) {
  uint32_t want = 2 * std::max<uint32_t>(auto_submit_, 16) + 2;
  want = std::min<uint32_t>(want, 1u << 17);
  // Grow only before this buffer references the pool (no reset recorded yet).
  if (s.query_capacity < want && !s.queries_reset) {
    if (s.queries) vkDestroyQueryPool(dev_, s.queries, nullptr);
    s.queries = VK_NULL_HANDLE;
    VkQueryPoolCreateInfo qi{VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO};
    qi.queryType = VK_QUERY_TYPE_TIMESTAMP;
    qi.queryCount = want;
    check(vkCreateQueryPool(dev_, &qi, nullptr, &s.queries), "vkCreateQueryPool");
    s.query_capacity = want;
  }
  if (!s.queries_reset) {
    // Queries must be reset before they are written; once per command buffer.
    vkCmdResetQueryPool(s.cmd, s.queries, 0, s.query_capacity);
    s.queries_reset = true;
  }
}

uint32_t Stream::ts_begin(uint32_t name_id, uint64_t flops, uint64_t bytes, uint64_t host_record_ns) {
  if (!profiling_) return kNoQuery;
  Slot& s = slots_[open_];
  ensure_queries(s);
  if (s.queries_used + 2 > s.query_capacity) return kNoQuery;
  uint32_t q = s.queries_used;
  s.queries_used += 2;
  vkCmdWriteTimestamp(s.cmd, VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, s.queries, q);
  s.events.push_back({name_id, q, flops, bytes, host_record_ns});
  return q;
}

void Stream::end_op(uint32_t query, bool is_dispatch, bool is_copy) {
  Slot& s = slots_[open_];
  if (query != kNoQuery) vkCmdWriteTimestamp(s.cmd, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, s.queries, query + 1);
  s.ops += 1;
  if (is_dispatch) {
    s.dispatches += 1;
    stats_.dispatches += 1;
  }
  if (is_copy) stats_.copies += 1;
  if (s.ops >= auto_submit_) submit_open();
}

VkDescriptorSet Stream::alloc_descriptor_set(VkDescriptorSetLayout layout) {
  Slot& s = slots_[open_];
  for (;;) {
    if (s.desc_cur == s.desc_pools.size()) {
      // Storage buffers, and the uniform texel buffers of kernels that read through texel views.
      VkDescriptorPoolSize sizes[2] = {{VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, kDescSetsPerPool * 8},
                                       {VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER, kDescSetsPerPool * 3}};
      VkDescriptorPoolCreateInfo ci{VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO};
      ci.maxSets = kDescSetsPerPool;
      ci.poolSizeCount = 2;
      ci.pPoolSizes = sizes;
      VkDescriptorPool pool;
      check(vkCreateDescriptorPool(dev_, &ci, nullptr, &pool), "vkCreateDescriptorPool");
      s.desc_pools.push_back(pool);
    }
    VkDescriptorSetAllocateInfo ai{VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO};
    ai.descriptorPool = s.desc_pools[s.desc_cur];
    ai.descriptorSetCount = 1;
    ai.pSetLayouts = &layout;
    VkDescriptorSet set;
    VkResult r = vkAllocateDescriptorSets(dev_, &ai, &set);
    if (r == VK_SUCCESS) return set;
    if (r != VK_ERROR_OUT_OF_POOL_MEMORY && r != VK_ERROR_FRAGMENTED_POOL) check(r, "vkAllocateDescriptorSets");
    s.desc_cur += 1;  // this pool is full: move to the next (made on demand)
  }
}

void Stream::submit_open() {
  if (open_ < 0) return;
  Slot& s = slots_[open_];
  if (s.wrote) {
    // Make device writes visible to host reads after the fence wait.
    VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
    mb.srcAccessMask = kWrites;
    mb.dstAccessMask = VK_ACCESS_HOST_READ_BIT;
    vkCmdPipelineBarrier(s.cmd, kWorkStages, VK_PIPELINE_STAGE_HOST_BIT, 0, 1, &mb, 0, nullptr, 0, nullptr);
  }
  check(vkEndCommandBuffer(s.cmd), "vkEndCommandBuffer");
  if (!s.events.empty() && calibrated_) {
    // Pair a device tick with CLOCK_MONOTONIC once per submission.
    VkCalibratedTimestampInfoEXT ci[2] = {{VK_STRUCTURE_TYPE_CALIBRATED_TIMESTAMP_INFO_EXT, nullptr, VK_TIME_DOMAIN_DEVICE_EXT},
                                          {VK_STRUCTURE_TYPE_CALIBRATED_TIMESTAMP_INFO_EXT, nullptr,
                                           VK_TIME_DOMAIN_CLOCK_MONOTONIC_EXT}};
    uint64_t ts[2], dev;
    if (get_calibrated_(dev_, 2, ci, ts, &dev) == VK_SUCCESS) {
      s.calibrated = true;
      s.calib_ticks = ts[0] & ts_mask_;
      s.calib_host_ns = int64_t(ts[1]);
    }
  }
  VkSubmitInfo si{VK_STRUCTURE_TYPE_SUBMIT_INFO};
  si.commandBufferCount = 1;
  si.pCommandBuffers = &s.cmd;
  s.host_submit_ns = monotonic_ns();
  if (timeline_) {
    VkTimelineSemaphoreSubmitInfo ts{VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO};
    ts.signalSemaphoreValueCount = 1;
    ts.pSignalSemaphoreValues = &s.serial;
    si.pNext = &ts;
    si.signalSemaphoreCount = 1;
    si.pSignalSemaphores = &timeline_;
    check(vkQueueSubmit(queue_, 1, &si, VK_NULL_HANDLE), "vkQueueSubmit");
  } else {
    check(vkResetFences(dev_, 1, &s.fence), "vkResetFences");
    check(vkQueueSubmit(queue_, 1, &si, s.fence), "vkQueueSubmit");
  }
  s.state = Slot::kInFlight;
  inflight_.push_back(open_);
  open_ = -1;
  stats_.submits += 1;
  poll();  // cheap: lets deferred frees of finished work go back to the pools
}

void Stream::retire_front() {
  int idx = inflight_.front();
  inflight_.pop_front();
  Slot& s = slots_[idx];
  uint64_t done_ns = monotonic_ns();
  if (!s.events.empty()) {
    // (value, availability) pairs.  No WAIT flag: the fence has signalled, and an
    // op whose recording threw half-way never wrote its end query -- waiting on
    // it would hang, so such events are dropped instead.
    std::vector<uint64_t> res(2 * size_t(s.queries_used));
    VkResult r = vkGetQueryPoolResults(dev_, s.queries, 0, s.queries_used, res.size() * 8, res.data(), 16,
                                       VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WITH_AVAILABILITY_BIT);
    check(r, "vkGetQueryPoolResults");  // VK_NOT_READY (some unavailable) is not an error
    auto ok = [&](uint32_t q) { return res[2 * q + 1] != 0 && res[2 * q + 3] != 0; };
    auto tick = [&](uint32_t q) { return res[2 * q] & ts_mask_; };
    // Ticks -> ns relative to a reference pair, so doubles never hold huge tick counts.
    uint64_t ref_ticks = UINT64_MAX;
    int64_t ref_ns;
    if (s.calibrated) {
      ref_ticks = s.calib_ticks, ref_ns = s.calib_host_ns;
    } else {
      // Without calibration, the first op is taken to start when the buffer was submitted.
      for (const auto& e : s.events)
        if (ok(e.query)) ref_ticks = std::min(ref_ticks, tick(e.query));
      ref_ns = int64_t(s.host_submit_ns);
    }
    const double period = info_.timestamp_period;
    auto to_ns = [&](uint64_t t) {
      // Signed tick difference modulo the counter width (counters narrower than 64 bits wrap).
      uint64_t d = (t - ref_ticks) & ts_mask_;
      int64_t sd = (ts_mask_ != ~0ull && d > (ts_mask_ >> 1)) ? int64_t(d) - int64_t(ts_mask_ + 1) : int64_t(d);
      return ref_ns + int64_t(double(sd) * period);
    };
    for (const auto& e : s.events) {
      if (!ok(e.query)) continue;
      int64_t a = to_ns(tick(e.query)), b = to_ns(tick(e.query + 1));
      done_events_.push_back({e.name_id, e.flops, e.bytes, a, std::max(a, b), s.serial, e.host_record_ns});
    }
    done_submits_.push_back({s.serial, s.host_submit_ns, done_ns, s.dispatches});
    s.events.clear();
  }
  if (!s.mark_ids.empty()) resolve_marks(s);
  s.accesses.clear();
  s.state = Slot::kIdle;
  completed_ = s.serial;
  if (on_complete_) on_complete_(completed_);
}

uint64_t Stream::finished_serial() {
  uint64_t v = 0;
  check(vkGetSemaphoreCounterValue(dev_, timeline_, &v), "vkGetSemaphoreCounterValue");
  return v;
}

void Stream::poll() {
  if (timeline_) {
    if (inflight_.empty()) return;
    const uint64_t done = finished_serial();  // one read retires every finished submission
    while (!inflight_.empty() && slots_[inflight_.front()].serial <= done) retire_front();
    return;
  }
  while (!inflight_.empty()) {
    VkResult r = vkGetFenceStatus(dev_, slots_[inflight_.front()].fence);
    if (r == VK_NOT_READY) return;
    check(r, "vkGetFenceStatus");
    retire_front();
  }
}

void Stream::wait_serial(uint64_t serial) {
  if (open_ >= 0 && slots_[open_].serial <= serial) submit_open();
  if (timeline_) {
    // One wait for the newest in-flight submission the caller needs, then retire up to it.
    uint64_t target = 0;
    for (int idx : inflight_)
      if (slots_[idx].serial <= serial) target = std::max(target, slots_[idx].serial);
    if (target == 0) return;
    if (finished_serial() < target) {
      stats_.fence_waits += 1;
      VkSemaphoreWaitInfo wi{VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO};
      wi.semaphoreCount = 1;
      wi.pSemaphores = &timeline_;
      wi.pValues = &target;
      check(vkWaitSemaphores(dev_, &wi, UINT64_MAX), "vkWaitSemaphores");
    }
    while (!inflight_.empty() && slots_[inflight_.front()].serial <= target) retire_front();
    return;
  }
  while (!inflight_.empty() && slots_[inflight_.front()].serial <= serial) {
    Slot& s = slots_[inflight_.front()];
    VkResult r = vkGetFenceStatus(dev_, s.fence);
    if (r == VK_NOT_READY) {
      stats_.fence_waits += 1;
      r = vkWaitForFences(dev_, 1, &s.fence, VK_TRUE, UINT64_MAX);
    }
    check(r, "vkWaitForFences");
    retire_front();
  }
}

void Stream::flush() { submit_open(); }

void Stream::synchronize() {
  submit_open();
  wait_serial(UINT64_MAX);
  if (last_serial_ > 0 && completed_ == last_serial_) {
    // Nothing is pending any more: start the hazard sets afresh.
    hazards_.clear();
    entry_barrier_ = true;
  }
  if (on_complete_) on_complete_(completed_);
}

uint64_t Stream::unfinished_access(Block* b, uint64_t begin, uint64_t end, bool writes_only) {
  if (b->last_serial <= completed_ || begin >= end) return 0;
  poll();
  if (b->last_serial <= completed_) return 0;
  uint64_t newest = 0;
  auto scan = [&](const Slot& s) {
    for (const Use& u : s.accesses)
      if (u.block == b && (u.write || !writes_only) && u.begin < end && begin < u.end) {
        newest = std::max(newest, s.serial);
        return;
      }
  };
  for (int idx : inflight_) scan(slots_[idx]);
  if (open_ >= 0) scan(slots_[open_]);
  return newest;
}

void Stream::set_profiling(bool on) {
  if (on && info_.timestamp_valid_bits == 0)
    throw std::runtime_error("profiling needs timestamps, but the compute queue of '" + info_.name +
                             "' has timestampValidBits = 0");
  profiling_ = on;
}

std::vector<Event> Stream::take_events() {
  poll();
  std::vector<Event> out;
  out.swap(done_events_);
  return out;
}

uint64_t Stream::mark() {
  if (!marks_supported())
    throw std::runtime_error("mark() needs timestamps, but the compute queue of '" + info_.name +
                             "' has timestampValidBits = 0 (or timestampPeriod = 0)");
  if (open_ < 0) open_slot();
  if (slots_[open_].mark_ids.size() == kMarksPerBuffer) {
    // This buffer's mark pool is full: go on in a new buffer rather than lose the mark.
    submit_open();
    open_slot();
  }
  Slot& s = slots_[open_];
  if (!s.mark_queries) {
    VkQueryPoolCreateInfo qi{VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO};
    qi.queryType = VK_QUERY_TYPE_TIMESTAMP;
    qi.queryCount = kMarksPerBuffer;
    check(vkCreateQueryPool(dev_, &qi, nullptr, &s.mark_queries), "vkCreateQueryPool");
  }
  if (!s.marks_reset) {
    vkCmdResetQueryPool(s.cmd, s.mark_queries, 0, kMarksPerBuffer);
    s.marks_reset = true;
  }
  // BOTTOM_OF_PIPE: written once every command recorded before it has completed.
  vkCmdWriteTimestamp(s.cmd, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, s.mark_queries, uint32_t(s.mark_ids.size()));
  const uint64_t id = next_mark_++;
  s.mark_ids.push_back(id);
  pending_marks_.emplace_back(id, s.serial);
  return id;
}

void Stream::resolve_marks(Slot& s) {
  const uint32_t n = uint32_t(s.mark_ids.size());
  std::vector<uint64_t> res(2 * size_t(n));
  // No WAIT flag: the submission has finished, every mark in it was written.
  VkResult r = vkGetQueryPoolResults(dev_, s.mark_queries, 0, n, res.size() * 8, res.data(), 16,
                                     VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WITH_AVAILABILITY_BIT);
  check(r, "vkGetQueryPoolResults");
  const double period = info_.timestamp_period;
  for (uint32_t i = 0; i < n; ++i) {
    if (res[2 * i + 1] == 0) continue;  // never written (the buffer was cut short): dropped
    const uint64_t t = res[2 * i] & ts_mask_;
    if (!mark_ref_set_) {
      mark_ref_set_ = true;
      mark_ref_ticks_ = t;
      mark_ref_ns_ = 0;
    }
    // Signed tick difference modulo the counter width, from the last resolved mark.
    uint64_t d = (t - mark_ref_ticks_) & ts_mask_;
    int64_t sd = (ts_mask_ != ~0ull && d > (ts_mask_ >> 1)) ? int64_t(d) - int64_t(ts_mask_ + 1) : int64_t(d);
    mark_ref_ns_ += int64_t(double(sd) * period + (sd >= 0 ? 0.5 : -0.5));
    mark_ref_ticks_ = t;
    done_marks_.push_back({s.mark_ids[i], mark_ref_ns_});
  }
  while (!pending_marks_.empty() && pending_marks_.front().second <= s.serial) pending_marks_.pop_front();
  s.mark_ids.clear();
}

void Stream::wait_mark(uint64_t id) {
  for (const auto& pm : pending_marks_)
    if (pm.first == id) {
      wait_serial(pm.second);
      return;
    }
  // Not pending: resolved already (or never handed out).
}

std::vector<Mark> Stream::take_marks() {
  poll();
  std::vector<Mark> out;
  out.swap(done_marks_);
  return out;
}

std::vector<SubmitRecord> Stream::take_submits() {
  std::vector<SubmitRecord> out;
  out.swap(done_submits_);
  return out;
}

}  // namespace helios_vk
