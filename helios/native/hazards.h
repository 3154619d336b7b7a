// Byte-range hazard tracking for the command stream.
//
// Since the last barrier the stream remembers, per VkBuffer, which byte ranges
// recorded commands read and which they wrote.  A new command needs a barrier
// only if it reads a pending write (RAW) or writes over a pending read or write
// (WAR/WAW).  A barrier is global, so after one both sets are empty: clearing
// is O(1) by bumping an epoch instead of visiting every buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace helios_vk {

// Sorted, disjoint, non-adjacent half-open intervals [begin, end).
class RangeSet {
 public:
  bool overlaps(uint64_t begin, uint64_t end) const;
  void add(uint64_t begin, uint64_t end);
  void clear() { iv_.clear(); }
  bool empty() const { return iv_.empty(); }
  size_t size() const { return iv_.size(); }

 private:
  std::vector<std::pair<uint64_t, uint64_t>> iv_;
};

// The pending reads and writes of one buffer, valid while epoch matches the tracker's.
struct BufferHazards {
  uint64_t epoch = 0;
  RangeSet reads, writes;
};

class HazardTracker {
 public:
  // Would an access to [begin, end) of this buffer need a barrier now?
  bool conflicts(const BufferHazards& h, uint64_t begin, uint64_t end, bool write) const {
    if (h.epoch != epoch_ || begin >= end) return false;
    if (h.writes.overlaps(begin, end)) return true;
    return write && h.reads.overlaps(begin, end);
  }
  // Remembers an access recorded since the last barrier.
  void record(BufferHazards& h, uint64_t begin, uint64_t end, bool write) {
    if (begin >= end) return;
    if (h.epoch != epoch_) {
      h.reads.clear();
      h.writes.clear();
      h.epoch = epoch_;
    }
    (write ? h.writes : h.reads).add(begin, end);
  }
  // A barrier was recorded (or everything completed): forget all pending accesses.
  void clear() { ++epoch_; }

 private:
  uint64_t epoch_ = 1;
};

}  // namespace helios_vk
