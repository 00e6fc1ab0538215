#include "trainer/gpu_health.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "trainer/metrics.h"

namespace trainer {

namespace {

// NVML's C API, the few calls used (nvml.h is not part of the toolkit we build with).
using Return = int;  // nvmlReturn_t: 0 is success
using Device = void*;
constexpr int kTemperatureGpu = 0;          // NVML_TEMPERATURE_GPU
constexpr int kMemoryErrorUncorrected = 1;  // NVML_MEMORY_ERROR_TYPE_UNCORRECTED
constexpr int kVolatileEcc = 0;             // NVML_VOLATILE_ECC

struct Reason {
  uint64_t bit;
  const char* name;
};
// nvmlClocksThrottleReasons: the ones that slow a busy GPU down (idle, application clocks and
// display settings are not slowdowns).
constexpr Reason kReasons[] = {{0x4, "power cap"},           {0x8, "hardware slowdown"},
                               {0x10, "sync boost"},         {0x20, "thermal (software)"},
                               {0x40, "thermal (hardware)"}, {0x80, "power brake"}};
constexpr uint64_t kSlowdowns = 0x4 | 0x8 | 0x10 | 0x20 | 0x40 | 0x80;

}  // namespace

struct GpuHealth::Api {
  Return (*init)();
  Return (*shutdown)();
  Return (*by_uuid)(const char*, Device*);
  Return (*temperature)(Device, int, unsigned*);
  Return (*power)(Device, unsigned*);
  Return (*ecc)(Device, int, int, unsigned long long*);
  Return (*throttle)(Device, unsigned long long*);
};

std::string throttle_names(uint64_t reasons) {
  std::string names;
  for (const Reason& r : kReasons)
    if (reasons & r.bit) names += (names.empty() ? "" : ", ") + std::string(r.name);
  return names;
}

std::string GpuHealth::uuid_string(const std::array<std::byte, 16>& uuid) {
  std::string s = "GPU-";
  for (int i = 0; i < 16; i++) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += fmt::format("{:02x}", unsigned(uuid[i]));
  }
  return s;
}

GpuHealth::GpuHealth(const std::array<std::byte, 16>& uuid, const char* library) {
  library_ = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (!library_) {
    note_ = fmt::format("{} not found (it comes with the NVIDIA driver)", library);
    return;
  }
  api_ = new Api{};
  auto bind = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(library_, name));
    return fn != nullptr;
  };
  if (!bind(api_->init, "nvmlInit_v2") || !bind(api_->shutdown, "nvmlShutdown") ||
      !bind(api_->by_uuid, "nvmlDeviceGetHandleByUUID")) {
    note_ = fmt::format("{} lacks nvmlInit_v2 or nvmlDeviceGetHandleByUUID", library);
    return;
  }
  // The readings each as the driver has them (a missing one stays unread); the throttle
  // reasons under their newer name first (the old one is deprecated).
  bind(api_->temperature, "nvmlDeviceGetTemperature");
  bind(api_->power, "nvmlDeviceGetPowerUsage");
  bind(api_->ecc, "nvmlDeviceGetTotalEccErrors");
  if (!bind(api_->throttle, "nvmlDeviceGetCurrentClocksEventReasons"))
    bind(api_->throttle, "nvmlDeviceGetCurrentClocksThrottleReasons");
  if (const Return r = api_->init(); r != 0) {
    note_ = fmt::format("nvmlInit failed (NVML error {})", r);
    return;
  }
  Device device = nullptr;
  const std::string id = uuid_string(uuid);
  if (const Return r = api_->by_uuid(id.c_str(), &device); r != 0 || !device) {
    note_ = fmt::format("NVML does not know GPU {} (NVML error {})", id, r);
    api_->shutdown();
    return;
  }
  device_ = device;
}

GpuHealth::~GpuHealth() {
  if (device_) api_->shutdown();
  delete api_;
  if (library_) dlclose(library_);
}

GpuReading GpuHealth::read() const {
  GpuReading g;
  if (!device_) return g;
  unsigned value = 0;
  if (api_->temperature && api_->temperature(device_, kTemperatureGpu, &value) == 0)
    g.temperature_c = value;
  if (api_->power && api_->power(device_, &value) == 0) g.power_w = value / 1e3;
  unsigned long long count = 0;
  if (api_->ecc && api_->ecc(device_, kMemoryErrorUncorrected, kVolatileEcc, &count) == 0)
    g.ecc_uncorrected = double(count);  // not supported (no ECC): stays NaN
  unsigned long long reasons = 0;
  if (api_->throttle && api_->throttle(device_, &reasons) == 0) g.throttle = reasons & kSlowdowns;
  return g;
}

GpuHealthWatch::GpuHealthWatch(const std::array<std::byte, 16>& uuid, Communicator& comm)
    : health_(uuid), comm_(comm), ecc_seen_(size_t(comm.size()), NAN) {
  double missing = health_.available() ? 0 : 1;
  comm_.all_reduce(host_ptr(&missing), 1, ReduceOp::sum);
  if (comm_.rank() == 0 && missing > 0)
    fmt::print("GPU health: NVML readings skipped on {} rank(s) ({} on rank 0)\n", missing,
               health_.available() ? "available" : health_.note());
}

bool GpuHealthWatch::read(int64_t step, MetricsLog* log) {
  const GpuReading g = health_.read();
  double mine[4] = {g.temperature_c, g.power_w, g.ecc_uncorrected, double(g.throttle)};
  std::vector<double> all(4 * size_t(comm_.size()));
  comm_.all_gather(host_ptr(mine), host_ptr(all.data()), 4);
  std::string grown;
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < comm_.size(); r++) {
    const double* v = &all[4 * size_t(r)];
    if (std::isfinite(v[2]) && std::isfinite(ecc_seen_[r]) && v[2] > ecc_seen_[r])
      grown += fmt::format("{}rank {}: {:.0f} (were {:.0f})", grown.empty() ? "" : ", ", r, v[2],
                           ecc_seen_[r]);
    ecc_seen_[r] = v[2];
    ranks.push_back({{"temperature_c", v[0]},
                     {"power_w", v[1]},
                     {"ecc_uncorrected", v[2]},
                     {"slowdown", throttle_names(uint64_t(v[3]))}});
  }
  if (log) log->event({{"step", step}, {"gpu", ranks}});
  if (comm_.rank() == 0 && !grown.empty())
    fmt::print("step {:6d} | warning: new uncorrected ECC errors on GPUs: {}\n", step, grown);
  return !grown.empty();
}

}  // namespace trainer
