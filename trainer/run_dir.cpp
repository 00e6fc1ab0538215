#include "trainer/run_dir.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/atomic_file.h"
#include "io/errors.h"
#include "trainer/checkpoint.h"

namespace trainer {

namespace fs = std::filesystem;

std::vector<std::string> run_files(const Config& cfg) {
  std::vector<std::string> files;
  for (const char* name : {"config.toml", "metrics.jsonl", "status.json"}) {
    const fs::path p = fs::path(cfg.run.out_dir) / name;
    if (fs::exists(p)) files.push_back(p.string());
  }
  const fs::path ckpt = checkpoint_dir(cfg);
  if (fs::is_directory(ckpt)) {
    std::vector<std::string> in_ckpt;
    for (const auto& e : fs::directory_iterator(ckpt)) {
      const std::string name = e.path().filename().string();
      if (name == "latest" || (e.is_directory() && name.starts_with("step_")))
        in_ckpt.push_back(e.path().string());
    }
    std::sort(in_ckpt.begin(), in_ckpt.end());
    files.insert(files.end(), in_ckpt.begin(), in_ckpt.end());
  }
  return files;
}

void check_fresh_run_dir(const Config& cfg, const std::string& config_path) {
  if (cfg.checkpoint.resume != "none" || cfg.run.overwrite) return;
  const std::vector<std::string> files = run_files(cfg);
  if (files.empty()) return;
  std::string listed;
  for (size_t i = 0; i < files.size() && i < 4; i++)
    listed += (i ? ", " : "") + fs::path(files[i]).lexically_relative(cfg.run.out_dir).string();
  if (files.size() > 4) listed += fmt::format(" and {} more", files.size() - 4);
  throw ConfigError(fmt::format(
      "{}: run.out_dir \"{}\" already holds a run ({}): a fresh run (checkpoint.resume = "
      "\"none\") will not mix with it; continue it with checkpoint.resume = \"auto\", replace it "
      "with run.overwrite = true, or choose another out_dir",
      config_path, cfg.run.out_dir, listed));
}

void remove_run_files(const Config& cfg) {
  for (const std::string& f : run_files(cfg)) fs::remove_all(f);
  remove_incomplete_checkpoints(checkpoint_dir(cfg));
}

void write_run_status(const Config& cfg, const RunStatus& status) {
  nlohmann::json j = {
      {"state", status.state},
      {"step", status.step},
      {"reason", status.reason},
      {"time",
       std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()}};
  j["code"] = status.code >= 0 ? nlohmann::json(status.code) : nlohmann::json(nullptr);
  const std::string text = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  write_file_atomic((fs::path(cfg.run.out_dir) / "status.json").string(), text);
  if (const char* also = std::getenv("TRAINER_STATUS_FILE"); also && *also)
    write_file_atomic(also, text);
}

}  // namespace trainer
