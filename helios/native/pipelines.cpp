// Pipeline creation and the on-disk pipeline cache.
#include "pipelines.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <tuple>

#include "vk_util.h"

namespace helios_vk {

uint64_t hash_bytes(const uint8_t* p, size_t n) {
  // FNV-style multiply-xor over 8-byte words: fast enough that re-hashing a
  // 50 KB shader costs microseconds, and 64 bits is plenty (hits are compared byte-wise).
  uint64_t h = 0xcbf29ce484222325ull ^ (n * 0x9e3779b97f4a7c15ull);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h ^ (h >> 32);
}

namespace {

// Minimal SPIR-V reflection: the GLCompute entry point's name, a check that every
// descriptor binding is in set 0 and below num_buffers (a shader reading a binding the
// layout lacks is undefined behaviour in the driver, so refuse it), and which bindings are
// uniform texel buffers (a `samplerBuffer`: Dim Buffer, sampled) rather than storage
// buffers: *texel_mask gets bit b for each, and *uint_mask bit b where the sampler's texels are
// integers (a `usamplerBuffer`: bound as an rgba32ui view, whose texels carry raw words such as
// packed 16-bit values, where an rgba32f view is for float32 data).  The shader is the one place
// that says so.
std::string check_spirv(const uint8_t* bytes, size_t n, uint32_t num_buffers, const std::string& name,
                        uint32_t* texel_mask, uint32_t* uint_mask) {
  if (n < 20 || n % 4)
    throw ArgError(strf("pipeline '%s': SPIR-V must be a non-empty multiple of 4 bytes, got %zu bytes", name.c_str(), n));
  std::vector<uint32_t> w(n / 4);
  std::memcpy(w.data(), bytes, n);
  if (w[0] != 0x07230203u)
    throw ArgError(strf("pipeline '%s': not SPIR-V (magic 0x%08x, expected 0x07230203); pass glslc output", name.c_str(), w[0]));
  std::string entry;
  std::map<uint32_t, uint32_t> binding_of, pointee_of, var_type, image_of_sampled;
  std::map<uint32_t, std::pair<uint32_t, uint32_t>> image_dim_sampled;  // OpTypeImage id -> (Dim, Sampled)
  std::map<uint32_t, uint32_t> image_texel_type;  // OpTypeImage id -> its sampled (texel component) type
  std::set<uint32_t> int_types;                   // OpTypeInt ids
  for (size_t i = 5; i < w.size();) {
    uint32_t count = w[i] >> 16, op = w[i] & 0xffff;
    if (count == 0 || i + count > w.size()) throw ArgError(strf("pipeline '%s': truncated SPIR-V at word %zu", name.c_str(), i));
    if (op == 15 && count >= 4 && w[i + 1] == 5 && entry.empty()) {  // OpEntryPoint GLCompute
      const char* s = reinterpret_cast<const char*>(&w[i + 3]);
      entry.assign(s, strnlen(s, (count - 3) * 4));
    } else if (op == 71 && count >= 4) {  // OpDecorate target decoration literal
      if (w[i + 2] == 34 && w[i + 3] != 0)  // DescriptorSet
        throw ArgError(strf("pipeline '%s': shader uses descriptor set %u; only set 0 is bound", name.c_str(), w[i + 3]));
      if (w[i + 2] == 33 && w[i + 3] >= num_buffers)  // Binding
        throw ArgError(strf("pipeline '%s': shader uses binding %u but num_buffers is %u", name.c_str(), w[i + 3],
                            num_buffers));
      if (w[i + 2] == 33) binding_of[w[i + 1]] = w[i + 3];
    } else if (op == 21 && count >= 4) {  // OpTypeInt result width signedness
      int_types.insert(w[i + 1]);
    } else if (op == 25 && count >= 9) {  // OpTypeImage result sampled-type Dim Depth Arrayed MS Sampled
      image_dim_sampled[w[i + 1]] = {w[i + 3], w[i + 7]};
      image_texel_type[w[i + 1]] = w[i + 2];
    } else if (op == 27 && count >= 3) {  // OpTypeSampledImage result image
      image_of_sampled[w[i + 1]] = w[i + 2];
    } else if (op == 32 && count >= 4) {  // OpTypePointer result storage-class type
      pointee_of[w[i + 1]] = w[i + 3];
    } else if (op == 59 && count >= 4) {  // OpVariable result-type result storage-class
      var_type[w[i + 2]] = w[i + 1];
    }
    i += count;
  }
  if (entry.empty()) throw ArgError(strf("pipeline '%s': SPIR-V has no GLCompute entry point", name.c_str()));
  *texel_mask = 0;
  *uint_mask = 0;
  for (const auto& [var, binding] : binding_of) {
    auto t = var_type.find(var);
    if (t == var_type.end()) continue;
    auto pt = pointee_of.find(t->second);
    uint32_t type = pt == pointee_of.end() ? 0 : pt->second;
    auto si = image_of_sampled.find(type);
    uint32_t image = si == image_of_sampled.end() ? type : si->second;
    auto im = image_dim_sampled.find(image);
    if (im == image_dim_sampled.end()) continue;  // a storage buffer
    if (im->second.first != 5 || si == image_of_sampled.end())  // Dim Buffer, combined with a sampler
      throw ArgError(strf("pipeline '%s': binding %u is an image other than a samplerBuffer; Helios binds storage "
                          "buffers and uniform texel buffers only", name.c_str(), binding));
    *texel_mask |= 1u << binding;
    if (int_types.count(image_texel_type[image])) *uint_mask |= 1u << binding;
  }
  return entry;
}

std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += d[p[i] >> 4], s += d[p[i] & 15];
  return s;
}

void make_dirs(const std::string& dir) {
  // mkdir -p: every missing component, tolerating ones that already exist.
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i < dir.size() && dir[i] != '/') continue;
    std::string part = dir.substr(0, i);
    if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      throw std::runtime_error(strf("cannot create pipeline cache dir %s: %s", part.c_str(), std::strerror(errno)));
  }
}

void write_file_atomic(const std::string& dir, const std::string& path, const void* data, size_t n) {
  make_dirs(dir);
  std::string tmp = strf("%s.tmp.%d", path.c_str(), int(getpid()));
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(strf("cannot write %s: %s", tmp.c_str(), std::strerror(errno)));
  const uint8_t* p = static_cast<const uint8_t*>(data);
  size_t left = n;
  while (left) {
    ssize_t k = write(fd, p, left);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      int e = errno;
      close(fd);
      unlink(tmp.c_str());
      throw std::runtime_error(strf("cannot write %s: %s", tmp.c_str(), std::strerror(e)));
    }
    p += k, left -= size_t(k);
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    unlink(tmp.c_str());
    throw std::runtime_error(strf("cannot fsync %s: %s", tmp.c_str(), std::strerror(errno)));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    unlink(tmp.c_str());
    throw std::runtime_error(strf("cannot rename %s to %s: %s", tmp.c_str(), path.c_str(), std::strerror(e)));
  }
  // The rename is durable only once the directory entry is.
  int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
}

}  // namespace

Pipelines::Pipelines(VkDevice dev, const PhysicalDeviceInfo& info, bool use_push_descriptors, std::string cache_dir)
    : dev_(dev), info_(info), use_push_(use_push_descriptors), cache_dir_(std::move(cache_dir)) {
  while (cache_dir_.size() > 1 && cache_dir_.back() == '/') cache_dir_.pop_back();
  load_cache();
}

Pipelines::~Pipelines() {
  for (auto& p : pipelines_) vkDestroyPipeline(dev_, p.pipeline, nullptr);
  for (auto& kv : layouts_) vkDestroyPipelineLayout(dev_, kv.second, nullptr);
  for (auto& kv : set_layouts_) vkDestroyDescriptorSetLayout(dev_, kv.second.first, nullptr);
  if (cache_) vkDestroyPipelineCache(dev_, cache_, nullptr);
}

std::string Pipelines::cache_path() const {
  if (cache_dir_.empty()) return "";
  return cache_dir_ + "/pipeline_cache_" + hex(info_.pipeline_cache_uuid.data(), VK_UUID_SIZE) + ".bin";
}

void Pipelines::load_cache() {
  std::vector<uint8_t> data;
  std::string path = cache_path();
  if (!path.empty()) {
    std::ifstream f(path, std::ios::binary);
    if (f) data.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    // Header (VkPipelineCacheHeaderVersionOne): size, version, vendor, device, uuid.
    // A file from another driver or device is ignored rather than handed to the driver.
    bool ok = data.size() >= 32;
    if (ok) {
      uint32_t hdr[4];
      std::memcpy(hdr, data.data(), 16);
      ok = hdr[0] >= 32 && hdr[1] == VK_PIPELINE_CACHE_HEADER_VERSION_ONE && hdr[2] == info_.vendor_id &&
           hdr[3] == info_.device_id && std::memcmp(data.data() + 16, info_.pipeline_cache_uuid.data(), VK_UUID_SIZE) == 0;
    }
    if (!ok) data.clear();
  }
  VkPipelineCacheCreateInfo ci{VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO};
  ci.initialDataSize = data.size();
  ci.pInitialData = data.empty() ? nullptr : data.data();
  VkResult r = vkCreatePipelineCache(dev_, &ci, nullptr, &cache_);
  if (r < 0 && !data.empty()) {
    // A corrupt cache must not stop the program: start empty.
    ci.initialDataSize = 0;
    ci.pInitialData = nullptr;
    r = vkCreatePipelineCache(dev_, &ci, nullptr, &cache_);
    data.clear();
  }
  check(r, "vkCreatePipelineCache");
  cache_loaded_ = !data.empty();
}

void Pipelines::save_cache() {
  std::string path = cache_path();
  if (path.empty() || !cache_) return;
  size_t n = 0;
  check(vkGetPipelineCacheData(dev_, cache_, &n, nullptr), "vkGetPipelineCacheData");
  std::vector<uint8_t> data(n);
  if (n) check(vkGetPipelineCacheData(dev_, cache_, &n, data.data()), "vkGetPipelineCacheData");
  data.resize(n);
  write_file_atomic(cache_dir_, path, data.data(), data.size());
}

VkDescriptorSetLayout Pipelines::set_layout(uint32_t num_buffers, uint32_t texel_mask, bool& push) {
  auto it = set_layouts_.find({num_buffers, texel_mask});
  if (it != set_layouts_.end()) {
    push = it->second.second;
    return it->second.first;
  }
  std::vector<VkDescriptorSetLayoutBinding> b(num_buffers);
  for (uint32_t i = 0; i < num_buffers; ++i) {
    b[i].binding = i;
    b[i].descriptorType = (texel_mask >> i) & 1 ? VK_DESCRIPTOR_TYPE_UNIFORM_TEXEL_BUFFER : VK_DESCRIPTOR_TYPE_STORAGE_BUFFER;
    b[i].descriptorCount = 1;
    b[i].stageFlags = VK_SHADER_STAGE_COMPUTE_BIT;
  }
  push = use_push_ && num_buffers > 0 && num_buffers <= info_.max_push_descriptors;
  VkDescriptorSetLayoutCreateInfo ci{VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO};
  ci.flags = push ? VK_DESCRIPTOR_SET_LAYOUT_CREATE_PUSH_DESCRIPTOR_BIT_KHR : 0;
  ci.bindingCount = num_buffers;
  ci.pBindings = b.data();
  VkDescriptorSetLayout layout;
  check(vkCreateDescriptorSetLayout(dev_, &ci, nullptr, &layout), "vkCreateDescriptorSetLayout");
  set_layouts_[{num_buffers, texel_mask}] = {layout, push};
  return layout;
}

VkPipelineLayout Pipelines::pipeline_layout(uint32_t num_buffers, uint32_t texel_mask, uint32_t push_size) {
  auto key = std::make_tuple(num_buffers, texel_mask, push_size);
  auto it = layouts_.find(key);
  if (it != layouts_.end()) return it->second;
  bool push = false;
  VkDescriptorSetLayout sl = set_layout(num_buffers, texel_mask, push);
  VkPushConstantRange pr{VK_SHADER_STAGE_COMPUTE_BIT, 0, push_size};
  VkPipelineLayoutCreateInfo ci{VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO};
  ci.setLayoutCount = 1;
  ci.pSetLayouts = &sl;
  ci.pushConstantRangeCount = push_size ? 1 : 0;
  ci.pPushConstantRanges = push_size ? &pr : nullptr;
  VkPipelineLayout layout;
  check(vkCreatePipelineLayout(dev_, &ci, nullptr, &layout), "vkCreatePipelineLayout");
  layouts_[key] = layout;
  return layout;
}

uint32_t Pipelines::get_or_create(const uint8_t* spirv, size_t nbytes, uint32_t num_buffers, uint32_t push_size,
                                  const std::vector<uint32_t>& spec, const std::string& name, uint32_t subgroup_size) {
  Key key{hash_bytes(spirv, nbytes), num_buffers, push_size, subgroup_size, spec};
  auto hit = by_key_.find(key);
  if (hit != by_key_.end())
    for (const auto& cand : hit->second)
      if (cand.first.size() == nbytes && std::memcmp(cand.first.data(), spirv, nbytes) == 0) return cand.second;

  if (num_buffers > kMaxBuffers)
    throw ArgError(strf("pipeline '%s': num_buffers %u is above the maximum of %u", name.c_str(), num_buffers, kMaxBuffers));
  if (push_size % 4 || push_size > info_.max_push_constants)
    throw ArgError(strf("pipeline '%s': push_size %u must be a multiple of 4 and at most the device's %u bytes",
                        name.c_str(), push_size, info_.max_push_constants));
  if (subgroup_size &&
      (subgroup_size < info_.min_subgroup_size || subgroup_size > info_.max_subgroup_size || (subgroup_size & (subgroup_size - 1))))
    throw ArgError(info_.min_subgroup_size
                       ? strf("pipeline '%s': subgroup_size %u is not a power of two in the device's %u..%u", name.c_str(),
                              subgroup_size, info_.min_subgroup_size, info_.max_subgroup_size)
                       : strf("pipeline '%s': subgroup_size %u asked of a device that cannot require a subgroup size "
                              "(Vulkan 1.3's subgroupSizeControl for compute)", name.c_str(), subgroup_size));
  uint32_t texel_mask = 0, uint_mask = 0;
  std::string entry = check_spirv(spirv, nbytes, num_buffers, name, &texel_mask, &uint_mask);

  Pipeline p;
  p.num_buffers = num_buffers;
  p.push_size = push_size;
  p.texel_mask = texel_mask;
  p.texel_uint_mask = uint_mask;
  p.name = name;
  p.layout = pipeline_layout(num_buffers, texel_mask, push_size);
  p.set_layout = set_layout(num_buffers, texel_mask, p.push_descriptor);

  VkShaderModuleCreateInfo smci{VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO};
  smci.codeSize = nbytes;
  std::vector<uint32_t> code(nbytes / 4);  // pCode must be 4-byte aligned; Python bytes need not be
  std::memcpy(code.data(), spirv, nbytes);
  smci.pCode = code.data();
  VkShaderModule module;
  check(vkCreateShaderModule(dev_, &smci, nullptr, &module), "vkCreateShaderModule");

  std::vector<VkSpecializationMapEntry> entries(spec.size());
  for (size_t i = 0; i < spec.size(); ++i) entries[i] = {uint32_t(i), uint32_t(4 * i), 4};
  VkSpecializationInfo si{uint32_t(entries.size()), entries.data(), spec.size() * 4, spec.data()};

  VkComputePipelineCreateInfo ci{VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO};
  ci.stage.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO;
  ci.stage.stage = VK_SHADER_STAGE_COMPUTE_BIT;
  ci.stage.module = module;
  ci.stage.pName = entry.c_str();
  ci.stage.pSpecializationInfo = spec.empty() ? nullptr : &si;
  // A kernel written for subgroups of one size (the cooperative-matrix kernels' lane shares)
  // runs in exactly those: drivers that pick a size per shader (Intel's SIMD8/16/32, AMD's
  // wave32/64) may otherwise run it in another than the one they report.  Full subgroups too,
  // where the device can promise them: a workgroup of whole subgroups has no partial one.
  VkPipelineShaderStageRequiredSubgroupSizeCreateInfo rss{
      VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_REQUIRED_SUBGROUP_SIZE_CREATE_INFO};
  if (subgroup_size) {
    rss.requiredSubgroupSize = subgroup_size;
    ci.stage.pNext = &rss;
    if (info_.compute_full_subgroups) ci.stage.flags |= VK_PIPELINE_SHADER_STAGE_CREATE_REQUIRE_FULL_SUBGROUPS_BIT;
  }
  ci.layout = p.layout;
  VkResult r = vkCreateComputePipelines(dev_, cache_, 1, &ci, nullptr, &p.pipeline);
  vkDestroyShaderModule(dev_, module, nullptr);  // the pipeline keeps what it needs
  check(r, "vkCreateComputePipelines");

  uint32_t id = uint32_t(pipelines_.size());
  pipelines_.push_back(std::move(p));
  by_key_[key].emplace_back(std::vector<uint8_t>(spirv, spirv + nbytes), id);
  return id;
}

}  // namespace helios_vk
