#pragma once
// Helpers shared by the unit tests: backend buffers from host vectors, seeded random data,
// and tolerance checks that report the worst element.
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"

// Skips a test, saying so, where no GPU is visible (the CUDA tests, CTest label `gpu`).
#define REQUIRE_GPU()                                             \
  do {                                                            \
    if (trainer::cuda_device_count() == 0)                        \
      GTEST_SKIP() << "no CUDA device visible: GPU test skipped"; \
  } while (0)

namespace trainer::test {

// Runs a shell command; returns its exit code (-1 if killed) and stdout + stderr together.
struct CommandResult {
  int code;
  std::string output;
};
inline CommandResult run_command(const std::string& command) {
  // Grouped, so that background jobs and every command of a list share the redirection.
  FILE* p = popen(("{ " + command + "\n} 2>&1").c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

#if defined(TRAINER_BIN) && defined(MPIEXEC) && defined(SOURCE_DIR)
// The trainer, mpiexec and the source tree: the build's paths, unless the environment names
// others (TRAINER_BIN, TRAINER_MPIEXEC, TRAINER_SOURCE_DIR), as the GPU bundle does when it runs
// these tests relocated on a machine without this build tree (scripts/gpu_check.sh --bundle).
inline std::string env_or(const char* name, const char* build_value) {
  const char* v = std::getenv(name);
  return v && *v ? v : build_value;
}
inline std::string trainer_bin() {
  return env_or("TRAINER_BIN", TRAINER_BIN);
}
inline std::string mpiexec() {
  return env_or("TRAINER_MPIEXEC", MPIEXEC);
}
inline std::string source_dir() {
  return env_or("TRAINER_SOURCE_DIR", SOURCE_DIR);
}
#endif

// Megatron-LM's indexed dataset (prefix.bin, prefix.idx), written independently of our reader by
// a few lines of numpy that follow megatron/core/datasets/indexed_dataset.py (_IndexWriter,
// IndexedDatasetBuilder.add_document). `datasets`: a Python list of (prefix, numpy dtype name,
// documents), each document a list of sequences of token ids; no single quotes.
inline CommandResult write_megatron(const std::string& datasets) {
  return run_command(
      "/usr/bin/python3 -c 'import struct, sys, numpy as np\n"
      "codes = dict(uint8=1, int8=2, int16=3, int32=4, int64=5, float64=6, float32=7, uint16=8)\n"
      "for prefix, dtype, docs in eval(sys.argv[1]):\n"
      "  lengths, doc_idx = [], [0]\n"
      "  with open(prefix + \".bin\", \"wb\") as f:\n"
      "    for doc in docs:\n"
      "      for seq in doc:\n"
      "        f.write(np.array(seq, dtype=dtype).tobytes())\n"
      "        lengths.append(len(seq))\n"
      "      doc_idx.append(len(lengths))\n"
      "  pointers = np.cumsum([0] + lengths)[:-1] * np.dtype(dtype).itemsize\n"
      "  with open(prefix + \".idx\", \"wb\") as f:\n"
      "    f.write(b\"MMIDIDX\\x00\\x00\" + struct.pack(\"<QBQQ\", 1, codes[dtype], len(lengths),"
      " len(doc_idx)))\n"
      "    f.write(np.array(lengths, np.int32).tobytes() + np.array(pointers, "
      "np.int64).tobytes())\n"
      "    f.write(np.array(doc_idx, np.int64).tobytes())' '" +
      datasets + "'");
}

// A fresh directory per test, removed afterwards.
// Standard base64 with padding (the tokens of a .tiktoken rank file).
inline std::string base64(const std::string& bytes) {
  static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t v = 0;
    for (size_t k = 0; k < 3; k++) v = v << 8 | (k < n ? uint8_t(bytes[i + k]) : 0);
    for (size_t k = 0; k < 4; k++) out += k <= n ? abc[(v >> (18 - 6 * k)) & 63] : '=';
  }
  return out;
}

// A tiktoken rank file: the 256 bytes (ranks 0-255), then `merges` in rank order.
inline void write_rank_file(const std::string& file, const std::vector<std::string>& merges) {
  std::ofstream out(file);
  int rank = 0;
  for (int b = 0; b < 256; b++) out << base64(std::string(1, char(b))) << " " << rank++ << "\n";
  for (const std::string& m : merges) out << base64(m) << " " << rank++ << "\n";
}
// A few merges of common English pairs, for handmade BPE tokenizers.
inline const std::vector<std::string> kEnglishMerges = {"th", "he", "in",   "er",  " t",
                                                        " a", "an", " the", "the", "ou"};

class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("trainer_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

// OpenMP's thread count set for a scope, the previous one restored however the scope ends.
class OmpThreads {
 public:
  explicit OmpThreads(int n) { omp_set_num_threads(n); }
  ~OmpThreads() { omp_set_num_threads(before_); }
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  int before_ = omp_get_max_threads();
};

// Owns backend buffers for one test.
class Device {
 public:
  Device() : k(make_cpu_kernels()) {}
  ~Device() {
    for (DPtr p : owned_) k->free(p);
  }
  template <class T>
  DPtr upload(const std::vector<T>& v) {
    DPtr p = k->alloc(int64_t(v.size()), dtype_of<T>());
    k->copy_from_host(p, v.data(), int64_t(v.size()));
    owned_.push_back(p);
    return p;
  }
  template <class T>
  std::vector<T> download(DPtr p, size_t n) {
    std::vector<T> v(n);
    k->copy_to_host(v.data(), p, int64_t(n));
    return v;
  }
  std::unique_ptr<Kernels> k;

 private:
  std::vector<DPtr> owned_;
};

// The cross-entropy's forward on one rank holding the whole vocabulary {0, V, Vp}: the mean loss,
// and the per-row statistics crossentropy_backward takes.
struct CrossEntropyForward {
  double mean;
  DPtr rowmax, sumexp;
};
template <class T>
CrossEntropyForward softmax_crossentropy(Device& d, DPtr losses, DPtr logits,
                                         const std::vector<int32_t>& targets, int V, int Vp) {
  const int64_t N = int64_t(targets.size());
  const VocabSlice all{0, V, Vp};
  DPtr rowmax = d.upload(std::vector<T>(N)), sumexp = d.upload(std::vector<T>(N)),
       target = d.upload(std::vector<T>(N));
  d.k->crossentropy_stats(rowmax, sumexp, target, logits, targets.data(), N, all);
  return {d.k->crossentropy_loss(losses, rowmax, sumexp, target, N), rowmax, sumexp};
}

template <class T = float>
std::vector<T> random_vector(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = T(dist(rng));
  return v;
}

// |got - want| <= atol + rtol * |want| elementwise; names the worst element on failure.
template <class A, class B>
::testing::AssertionResult all_close(const std::vector<A>& got, const std::vector<B>& want,
                                     double rtol, double atol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); i++) {
    const double err = std::abs(double(got[i]) - double(want[i]));
    const double excess = err - (atol + rtol * std::abs(double(want[i])));
    if (!(excess <= worst) || std::isnan(err)) {
      worst = std::isnan(err) ? INFINITY : excess;
      at = i;
    }
  }
  if (worst > 0)
    return ::testing::AssertionFailure()
           << "element " << at << ": got " << double(got[at]) << ", want " << double(want[at])
           << " (rtol " << rtol << ", atol " << atol << ")";
  return ::testing::AssertionSuccess();
}

}  // namespace trainer::test
