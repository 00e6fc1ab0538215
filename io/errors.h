#pragma once
// Bad input (a config, a data file, a checkpoint) is reported, not crashed on: every such error
// derives from InputError, carries one line naming the file and what is wrong, and ends the
// program with exit code 2 at the top level.
#include <stdexcept>
#include <string>

namespace trainer {

class InputError : public std::runtime_error {
 public:
  InputError(const char* category, const std::string& what)
      : std::runtime_error(what), category_(category) {}
  const char* category() const { return category_; }  // "config", "data", "checkpoint"

 private:
  const char* category_;
};

class ConfigError : public InputError {
 public:
  explicit ConfigError(const std::string& what) : InputError("config", what) {}
};

class DataError : public InputError {
 public:
  explicit DataError(const std::string& what) : InputError("data", what) {}
};

class CheckpointError : public InputError {
 public:
  explicit CheckpointError(const std::string& what) : InputError("checkpoint", what) {}
};

}  // namespace trainer
