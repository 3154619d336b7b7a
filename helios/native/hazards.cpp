// Interval set used by the hazard tracker.  Sets stay small (one interval per
// tensor touched since the last barrier), so a sorted vector with binary search
// beats any tree.
#include "hazards.h"

#include <algorithm>

namespace helios_vk {

bool RangeSet::overlaps(uint64_t begin, uint64_t end) const {
  if (begin >= end || iv_.empty()) return false;
  // First interval whose end is past `begin`; it overlaps iff it starts before `end`.
  auto it = std::upper_bound(iv_.begin(), iv_.end(), begin,
                             [](uint64_t b, const std::pair<uint64_t, uint64_t>& p) { return b < p.second; });
  return it != iv_.end() && it->first < end;
}

void RangeSet::add(uint64_t begin, uint64_t end) {
  if (begin >= end) return;
  // Fast path: appending past the last interval (the common case for fresh tensors).
  if (iv_.empty() || begin > iv_.back().second) {
    iv_.emplace_back(begin, end);
    return;
  }
  // First interval that ends at or after `begin` (adjacent ones merge too).
  auto lo = std::lower_bound(iv_.begin(), iv_.end(), begin,
                             [](const std::pair<uint64_t, uint64_t>& p, uint64_t b) { return p.second < b; });
  auto hi = lo;
  while (hi != iv_.end() && hi->first <= end) {
    begin = std::min(begin, hi->first);
    end = std::max(end, hi->second);
    ++hi;
  }
  if (lo == hi) {
    iv_.insert(lo, {begin, end});
  } else {
    *lo = {begin, end};
    iv_.erase(lo + 1, hi);
  }
}

}  // namespace helios_vk
