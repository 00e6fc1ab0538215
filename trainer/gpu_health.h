#pragma once
// A GPU's health as NVML reports it, for the metrics and the step guard: temperature, power,
// uncorrected ECC errors since the driver loaded, and the reasons its clocks are held down
// (thermal or power slowdown). NVML comes with the driver, not the toolkit, so
// libnvidia-ml.so.1 is opened at run time; where it is absent (or does not know the GPU) the
// readings are skipped and note() says why.
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

class Communicator;
class MetricsLog;

struct GpuReading {
  double temperature_c = NAN, power_w = NAN;
  double ecc_uncorrected = NAN;  // volatile count: since the driver loaded
  uint64_t throttle = 0;         // NVML's clocks-throttle-reason bits, idle and settings left out
};

// The names of throttle reason bits: "thermal (software), power cap" ("" for none).
std::string throttle_names(uint64_t reasons);

class GpuHealth {
 public:
  // uuid: the GPU's (cuda_device_uuid); library: the NVML to open.
  explicit GpuHealth(const std::array<std::byte, 16>& uuid,
                     const char* library = "libnvidia-ml.so.1");
  ~GpuHealth();
  GpuHealth(const GpuHealth&) = delete;
  GpuHealth& operator=(const GpuHealth&) = delete;

  bool available() const { return device_ != nullptr; }
  const std::string& note() const { return note_; }  // why not available
  GpuReading read() const;

  // NVML's form of a UUID: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
  static std::string uuid_string(const std::array<std::byte, 16>& uuid);

 private:
  struct Api;
  void* library_ = nullptr;
  void* device_ = nullptr;
  Api* api_ = nullptr;
  std::string note_;
};

// Every rank's GPU health at the log interval: temperature, power, uncorrected ECC errors and
// clock slowdowns, gathered and logged by rank 0. Collective: every rank of a CUDA run takes
// part (NaN where NVML is absent), so that the gather is.
class GpuHealthWatch {
 public:
  // Collective; rank 0 says on how many ranks NVML's readings will be skipped.
  GpuHealthWatch(const std::array<std::byte, 16>& uuid, Communicator& comm);
  // Collective: every rank's reading, logged by rank 0 in `log` (null elsewhere). True when a
  // rank's GPU reports uncorrected ECC errors it did not at its last reading (a count that could
  // not be read is not compared); rank 0 prints which.
  bool read(int64_t step, MetricsLog* log);

 private:
  GpuHealth health_;
  Communicator& comm_;
  std::vector<double> ecc_seen_;  // each rank's uncorrected ECC errors at its last reading
};

}  // namespace trainer
