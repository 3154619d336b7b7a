// VkResult names, the error types and the host clock.
#include "vk_util.h"

#include <cstdarg>
#include <cstdio>
#include <ctime>

namespace helios_vk {

const char* result_name(VkResult r) {
  switch (r) {
#define HV_CASE(x) \
  case x:          \
    return #x;
    HV_CASE(VK_SUCCESS)
    HV_CASE(VK_NOT_READY)
    HV_CASE(VK_TIMEOUT)
    HV_CASE(VK_EVENT_SET)
    HV_CASE(VK_EVENT_RESET)
    HV_CASE(VK_INCOMPLETE)
    HV_CASE(VK_ERROR_OUT_OF_HOST_MEMORY)
    HV_CASE(VK_ERROR_OUT_OF_DEVICE_MEMORY)
    HV_CASE(VK_ERROR_INITIALIZATION_FAILED)
    HV_CASE(VK_ERROR_DEVICE_LOST)
    HV_CASE(VK_ERROR_MEMORY_MAP_FAILED)
    HV_CASE(VK_ERROR_LAYER_NOT_PRESENT)
    HV_CASE(VK_ERROR_EXTENSION_NOT_PRESENT)
    HV_CASE(VK_ERROR_FEATURE_NOT_PRESENT)
    HV_CASE(VK_ERROR_INCOMPATIBLE_DRIVER)
    HV_CASE(VK_ERROR_TOO_MANY_OBJECTS)
    HV_CASE(VK_ERROR_FORMAT_NOT_SUPPORTED)
    HV_CASE(VK_ERROR_FRAGMENTED_POOL)
    HV_CASE(VK_ERROR_UNKNOWN)
    HV_CASE(VK_ERROR_OUT_OF_POOL_MEMORY)
    HV_CASE(VK_ERROR_INVALID_EXTERNAL_HANDLE)
    HV_CASE(VK_ERROR_FRAGMENTATION)
    HV_CASE(VK_ERROR_INVALID_OPAQUE_CAPTURE_ADDRESS)
    HV_CASE(VK_PIPELINE_COMPILE_REQUIRED)
    HV_CASE(VK_ERROR_SURFACE_LOST_KHR)
    HV_CASE(VK_ERROR_NATIVE_WINDOW_IN_USE_KHR)
    HV_CASE(VK_SUBOPTIMAL_KHR)
    HV_CASE(VK_ERROR_OUT_OF_DATE_KHR)
    HV_CASE(VK_ERROR_INCOMPATIBLE_DISPLAY_KHR)
    HV_CASE(VK_ERROR_VALIDATION_FAILED_EXT)
    HV_CASE(VK_ERROR_INVALID_SHADER_NV)
    HV_CASE(VK_ERROR_NOT_PERMITTED_KHR)
#undef HV_CASE
    default:
      return "VK_RESULT_UNKNOWN";
  }
}

static std::string vulkan_message(const char* fn, VkResult r) {
  std::string m = std::string(fn) + " failed: " + result_name(r);
  if (r == VK_ERROR_UNKNOWN || result_name(r) == std::string("VK_RESULT_UNKNOWN")) m += " (" + std::to_string(int(r)) + ")";
  if (r == VK_ERROR_DEVICE_LOST)
    m += "; the device was lost (driver reset or a faulting kernel): close this Device and create a new one";
  return m;
}

VulkanError::VulkanError(const char* fn, VkResult r) : std::runtime_error(vulkan_message(fn, r)), result(r) {}

uint64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

std::string strf(const char* fmt, ...) {
  char small[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(small, sizeof small, fmt, ap);
  va_end(ap);
  if (n < int(sizeof small)) return std::string(small, n < 0 ? 0 : n);
  std::string out(size_t(n) + 1, '\0');
  va_start(ap, fmt);
  vsnprintf(out.data(), out.size(), fmt, ap);
  va_end(ap);
  out.resize(size_t(n));
  return out;
}

}  // namespace helios_vk
