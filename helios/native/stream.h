// The command stream: a ring of command buffers with fences, lazy begin,
// hazard barriers, batched submits, completion tracking and timestamps.
//
// Every op (dispatch, copy, fill) goes through the same four steps:
//   VkCommandBuffer cmd = stream.begin_op(uses, n);   // open + barrier if needed
//   uint32_t q = stream.ts_begin(name, flops, bytes);  // profiling only
//   ... vkCmd* into cmd ...
//   stream.end_op(q, is_dispatch);                      // auto-submit
#pragma once

#include <vulkan/vulkan.h>

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "hazards.h"
#include "instance.h"
#include "memory.h"

namespace helios_vk {

// One buffer range an op touches.
struct Use {
  Block* block;
  uint64_t begin, end;  // absolute byte range in block->buffer
  bool write;
};

struct StreamStats {
  uint64_t submits = 0, dispatches = 0, barriers = 0, fence_waits = 0, copies = 0;
};

// A completed, timed op.
struct Event {
  uint32_t name_id;
  uint64_t flops, bytes;
  int64_t start_ns, end_ns;
  uint64_t submit;
  uint64_t host_record_ns;
};

struct SubmitRecord {
  uint64_t submit, host_submit_ns, host_done_ns, dispatches;
};

// A resolved mark: its id and the device time it was written at (ns on the device's
// timestamp clock, not the host's; only differences between marks mean anything).
struct Mark {
  uint64_t id;
  int64_t device_ns;
};

class Stream {
 public:
  static constexpr int kRing = 4;
  static constexpr uint32_t kNoQuery = UINT32_MAX;

  // on_complete(serial) runs whenever every submission up to `serial` has finished.
  Stream(VkDevice dev, VkQueue queue, const PhysicalDeviceInfo& info, bool calibrated,
         std::function<void(uint64_t)> on_complete);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // Opens the command buffer if needed and records a barrier if any use
  // conflicts with an access since the last barrier.  Returns the buffer to record into.
  VkCommandBuffer begin_op(const Use* uses, size_t n);
  // Timestamp before the op (profiling on); returns the query index or kNoQuery.
  uint32_t ts_begin(uint32_t name_id, uint64_t flops, uint64_t bytes, uint64_t host_record_ns);
  // Timestamp after the op, counts it, submits when the buffer holds enough work.
  void end_op(uint32_t query, bool is_dispatch, bool is_copy);

  // A descriptor set for the fallback path (no push descriptors), from a pool
  // that is reset when this command buffer's submission completes.
  VkDescriptorSet alloc_descriptor_set(VkDescriptorSetLayout layout);
  // vkCmdBindPipeline only when it changes within the command buffer.
  void bind_pipeline(VkCommandBuffer cmd, VkPipeline p) {
    if (slots_[open_].bound != p) {
      vkCmdBindPipeline(cmd, VK_PIPELINE_BIND_POINT_COMPUTE, p);
      slots_[open_].bound = p;
    }
  }

  void flush();          // submit what is recorded, do not wait
  void synchronize();    // submit and wait for everything
  void poll();           // retire submissions the device finished (no waiting)
  void wait_serial(uint64_t serial);  // submit if needed and wait until `serial` completed

  // Serial of the newest unfinished op touching [begin, end) of the block (only
  // writes if writes_only), or 0 if no unfinished op does.
  uint64_t unfinished_access(Block* b, uint64_t begin, uint64_t end, bool writes_only);

  // The serial a free() must wait for: the open buffer's, else the last submitted.
  uint64_t current_serial() const { return last_serial_; }
  uint64_t completed_serial() const { return completed_; }
  // Serial of the newest submitted (not merely recorded) command buffer.
  uint64_t submitted_serial() const { return open_ >= 0 ? last_serial_ - 1 : last_serial_; }
  bool idle() const { return open_ < 0 && inflight_.empty(); }

  void set_profiling(bool on);
  bool profiling() const { return profiling_; }
  std::vector<Event> take_events();
  std::vector<SubmitRecord> take_submits();

  // Marks: a timestamp written into the command stream at the current point, once
  // everything recorded before it has finished (BOTTOM_OF_PIPE), whether profiling is on or
  // not.  Device time between two marks is the device time of the work between them, read
  // without waiting: a mark resolves when its submission retires (timeline counter read).
  bool marks_supported() const { return info_.timestamp_valid_bits > 0 && info_.timestamp_period > 0.f; }
  uint64_t mark();                    // its id (> 0); throws where marks_supported() is false
  void wait_mark(uint64_t id);        // submit if needed and wait until the mark's submission finished
  std::vector<Mark> take_marks();     // the marks resolved since the last take (never waits)

  uint32_t auto_submit() const { return auto_submit_; }
  void set_auto_submit(uint32_t n) { auto_submit_ = n; }
  const StreamStats& stats() const { return stats_; }
  uint64_t pending_ops() const { return open_ >= 0 ? slots_[open_].ops : 0; }
  void reset_stats() { stats_ = StreamStats{}; }

 private:
  struct PendingEvent {
    uint32_t name_id;
    uint32_t query;
    uint64_t flops, bytes, host_record_ns;
  };
  struct Slot {
    VkCommandPool pool = VK_NULL_HANDLE;
    VkCommandBuffer cmd = VK_NULL_HANDLE;
    VkFence fence = VK_NULL_HANDLE;  // only without a timeline semaphore
    enum { kIdle, kRecording, kInFlight } state = kIdle;
    uint64_t serial = 0;
    uint32_t ops = 0, dispatches = 0;
    bool wrote = false;
    VkPipeline bound = VK_NULL_HANDLE;
    std::vector<Use> accesses;  // what this submission touches (host read/write hazards)
    // Profiling.
    VkQueryPool queries = VK_NULL_HANDLE;
    uint32_t query_capacity = 0, queries_used = 0;
    bool queries_reset = false;
    std::vector<PendingEvent> events;
    // Marks: their own small query pool (reset once per buffer), ids in query order.
    VkQueryPool mark_queries = VK_NULL_HANDLE;
    bool marks_reset = false;
    std::vector<uint64_t> mark_ids;
    uint64_t host_submit_ns = 0;
    bool calibrated = false;
    uint64_t calib_ticks = 0;
    int64_t calib_host_ns = 0;
    // Descriptor fallback.
    std::vector<VkDescriptorPool> desc_pools;
    size_t desc_cur = 0;
  };

  void open_slot();
  void submit_open();
  void retire_front();
  void record_barrier(VkCommandBuffer cmd);
  void ensure_queries(Slot& s);

  VkDevice dev_;
  VkQueue queue_;
  const PhysicalDeviceInfo& info_;
  bool calibrated_;
  PFN_vkGetCalibratedTimestampsEXT get_calibrated_ = nullptr;
  std::function<void(uint64_t)> on_complete_;
  // Completion tracking: one timeline semaphore that each submission signals with its serial
  // (Vulkan 1.2), so "is serial N done" is one counter read and "wait for N" one wait; a
  // fence per ring slot on devices without it.
  VkSemaphore timeline_ = VK_NULL_HANDLE;
  uint64_t finished_serial();  // the newest serial the device has finished (timeline only)

  std::array<Slot, kRing> slots_;
  int open_ = -1;          // slot being recorded, -1 if none
  int next_ = 0;           // ring position of the next slot to open
  std::deque<int> inflight_;  // submitted slots, oldest first
  uint64_t next_serial_ = 1, last_serial_ = 0, completed_ = 0;
  bool entry_barrier_ = false;  // after a full wait, order the next buffer against all earlier work

  HazardTracker hazards_;
  uint32_t auto_submit_ = 256;
  bool profiling_ = false;
  uint64_t ts_mask_;
  StreamStats stats_;
  std::vector<Event> done_events_;
  std::vector<SubmitRecord> done_submits_;
  // Marks: ids are handed out in recording order; (id, serial) of the unresolved ones, oldest
  // first; resolved ones wait in done_marks_.  Ticks are unwrapped against the last resolved
  // mark (counters narrower than 64 bits wrap).
  static constexpr uint32_t kMarksPerBuffer = 64;
  void resolve_marks(Slot& s);
  uint64_t next_mark_ = 1;
  std::deque<std::pair<uint64_t, uint64_t>> pending_marks_;
  std::vector<Mark> done_marks_;
  bool mark_ref_set_ = false;
  uint64_t mark_ref_ticks_ = 0;
  int64_t mark_ref_ns_ = 0;
};

}  // namespace helios_vk
