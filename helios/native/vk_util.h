// Small helpers shared by every part of the Vulkan addon: error types, VkResult
// checking, the host clock.  Nothing here knows about Python: the bindings in
// module.cpp translate the C++ exception types below into Python ones.
#pragma once

#include <vulkan/vulkan.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace helios_vk {

// A VkResult error.  Becomes RuntimeError("vkQueueSubmit failed: VK_ERROR_DEVICE_LOST").
class VulkanError : public std::runtime_error {
 public:
  VulkanError(const char* fn, VkResult r);
  VkResult result;
};

// Device memory exhausted (or a request above a device limit).  Becomes the
// module's OutOfMemoryError (a MemoryError).
class OutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad arguments from the caller.  pybind11 maps std::invalid_argument to ValueError.
using ArgError = std::invalid_argument;

// "VK_ERROR_DEVICE_LOST" for a VkResult.
const char* result_name(VkResult r);

// Throws VulkanError for any negative VkResult.
inline void check(VkResult r, const char* fn) {
  if (r < 0) throw VulkanError(fn, r);
}

// CLOCK_MONOTONIC in nanoseconds (the host clock profiling events are mapped to;
// the same clock as Python's time.monotonic_ns() on Linux).
uint64_t monotonic_ns();

inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// printf-style std::string formatting for error messages.
std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace helios_vk
