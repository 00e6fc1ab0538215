#pragma once
// Reading a TOML config section by section (io/config.cpp): typed fields with range checks,
// every key consumed, errors that name the file, line and key (or the --set that gave it).
#include <fmt/format.h>
#include <toml++/toml.h>

#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "io/config.h"

namespace trainer::config_reader {

// Where a value came from, for error messages: "file:line:col" or "--set a.b=c".
using Origins = std::map<std::string, std::string>;

inline std::string where(const toml::source_region& s, const std::string& file) {
  return fmt::format("{}:{}:{}", file, s.begin.line, s.begin.column);
}
inline std::string where(const toml::node& node, const std::string& file) {
  return where(node.source(), file);
}

// "a string", "an integer", ...: a node's type in messages.
const char* type_name(const toml::node& n);

// Reads the keys of one section into typed fields; every key must be consumed.
class SectionReader {
 public:
  SectionReader(toml::table& root, std::string section, const std::string& file,
                const Origins& overrides)
      : section_(std::move(section)), file_(file), overrides_(overrides) {
    if (toml::node* n = root.at_path(section_).node()) {
      table_ = n->as_table();
      if (!table_)
        fail(*n, fmt::format("expected a table [{}], found {}", section_, type_name(*n)));
    }
  }

  template <class T, class Check = std::nullptr_t>
  void field(const std::string& key, T& out, Check check = nullptr) {
    if (!table_) return;
    toml::node* node = table_->get(key);
    if (!node) return;
    seen_.insert(key);
    key_ = key;
    read(*node, out);
    if constexpr (!std::is_same_v<Check, std::nullptr_t>) {
      if (std::optional<std::string> problem = check(out)) fail(*node, *problem);
    }
  }

  // Where `key` was set (for cross-field errors), or the section if it was not.
  std::string origin(const std::string& key) const {
    std::string full = section_ + "." + key;
    if (auto it = overrides_.find(full); it != overrides_.end()) return it->second;
    if (table_)
      if (const toml::node* n = table_->get(key)) return where(*n, file_);
    return file_;
  }

  bool has(const std::string& key) const { return table_ && table_->get(key); }
  // Whether `key` is the string `word` (then it counts as read); else field() reads it.
  bool is_word(const std::string& key, const std::string& word) {
    const toml::node* n = table_ ? table_->get(key) : nullptr;
    if (!n || n->value_exact<std::string>() != word) return false;
    seen_.insert(key);
    return true;
  }

  void finish() {
    if (!table_) return;
    for (auto& [k, v] : *table_)
      if (!seen_.count(std::string(k.str()))) {
        key_ = std::string(k.str());
        fail(k.source(), "unknown key");
      }
  }

  [[noreturn]] void fail(const toml::node& node, const std::string& what) const {
    fail(node.source(), what);
  }
  [[noreturn]] void fail(const toml::source_region& source, const std::string& what) const {
    std::string full = section_ + "." + key_;
    auto it = overrides_.find(full);
    std::string at = it != overrides_.end() ? it->second : where(source, file_);
    if (key_.empty()) throw ConfigError(fmt::format("{}: [{}]: {}", at, section_, what));
    throw ConfigError(fmt::format("{}: [{}] {}: {}", at, section_, key_, what));
  }

 private:
  [[noreturn]] void wrong_type(const toml::node& n, const char* expected) const {
    fail(n, fmt::format("expected {}, found {}", expected, type_name(n)));
  }
  void read(const toml::node& n, int& out) const {
    auto v = n.value_exact<int64_t>();
    if (!v) wrong_type(n, "an integer");
    if (*v < std::numeric_limits<int>::min() || *v > std::numeric_limits<int>::max())
      fail(n, fmt::format("{} does not fit in 32 bits", *v));
    out = int(*v);
  }
  void read(const toml::node& n, uint64_t& out) const {
    auto v = n.value_exact<int64_t>();
    if (!v) wrong_type(n, "an integer");
    if (*v < 0) fail(n, fmt::format("must be >= 0, found {}", *v));
    out = uint64_t(*v);
  }
  void read(const toml::node& n, double& out) const {
    if (auto v = n.value_exact<double>())
      out = *v;
    else if (auto i = n.value_exact<int64_t>())
      out = double(*i);
    else
      wrong_type(n, "a number");
  }
  void read(const toml::node& n, bool& out) const {
    auto v = n.value_exact<bool>();
    if (!v) wrong_type(n, "a boolean");
    out = *v;
  }
  void read(const toml::node& n, std::string& out) const {
    auto v = n.value_exact<std::string>();
    if (!v) wrong_type(n, "a string");
    out = *v;
  }
  void read(const toml::node& n, std::vector<std::string>& out) const {
    if (auto s = n.value_exact<std::string>()) {
      out = {*s};
      return;
    }
    const toml::array* a = n.as_array();
    if (!a || a->empty()) wrong_type(n, "a string or a non-empty array of strings");
    out.clear();
    for (const auto& e : *a) {
      auto s = e.value_exact<std::string>();
      if (!s) wrong_type(e, "a string");
      out.push_back(*s);
    }
  }
  // [[data.sources]]: an array of tables {path, weight}.
  void read(const toml::node& n, std::vector<DataSource>& out) const {
    const toml::array* a = n.as_array();
    if (!a || a->empty() || !a->is_array_of_tables())
      wrong_type(n, "a non-empty array of tables [[data.sources]] with path and weight");
    out.clear();
    for (const toml::node& e : *a) {
      const toml::table& t = *e.as_table();
      DataSource src;
      for (const auto& [k, v] : t) {
        if (k.str() == "path")
          read(v, src.path);
        else if (k.str() == "weight") {
          read(v, src.weight);
          if (!(src.weight > 0) || !std::isfinite(src.weight))
            fail(v, fmt::format("source {}: weight must be a finite number > 0, found {}",
                                out.size(), src.weight));
        } else {
          fail(k.source(), fmt::format("source {}: unknown key \"{}\" (expected path and weight)",
                                       out.size(), k.str()));
        }
      }
      if (src.path.empty())
        fail(e,
             fmt::format("source {}: expected a path (shards or globs), found none", out.size()));
      out.push_back(std::move(src));
    }
  }
  // [[at, value], ...]: rows of two integers.
  void read(const toml::node& n, std::vector<std::array<int64_t, 2>>& out) const {
    const toml::array* a = n.as_array();
    if (!a || a->empty()) wrong_type(n, "a non-empty array of [at, value] pairs");
    out.clear();
    for (const toml::node& row : *a) {
      const toml::array* pair = row.as_array();
      if (!pair || pair->size() != 2) wrong_type(row, "a pair [at, value] of integers");
      std::array<int64_t, 2> v{};
      for (size_t i = 0; i < 2; i++) {
        const auto x = pair->get(i)->value_exact<int64_t>();
        if (!x) wrong_type(*pair->get(i), "an integer");
        v[i] = *x;
      }
      out.push_back(v);
    }
  }
  void read(const toml::node& n, std::array<int64_t, 2>& out) const {
    const toml::array* a = n.as_array();
    if (!a || a->size() != 2) wrong_type(n, "an array of two integers");
    for (size_t i = 0; i < 2; i++) {
      const auto x = a->get(i)->value_exact<int64_t>();
      if (!x) wrong_type(*a->get(i), "an integer");
      out[i] = *x;
    }
  }
  void read(const toml::node& n, std::array<double, 2>& out) const {
    const toml::array* a = n.as_array();
    if (!a || a->size() != 2) wrong_type(n, "an array of two numbers");
    for (size_t i = 0; i < 2; i++) read(*a->get(i), out[i]);
  }

  toml::table* table_ = nullptr;
  std::string section_, key_;
  const std::string& file_;
  const Origins& overrides_;
  std::set<std::string> seen_;
};

// Range checks: return a message when the value is out of range.
inline auto at_least(double lo) {
  return [lo](auto v) -> std::optional<std::string> {
    if (double(v) >= lo) return std::nullopt;
    return fmt::format("must be >= {}, found {}", lo, v);
  };
}
inline auto in_range(double lo, double hi) {
  return [lo, hi](auto v) -> std::optional<std::string> {
    if (double(v) >= lo && double(v) <= hi) return std::nullopt;
    return fmt::format("must be in [{}, {}], found {}", lo, hi, v);
  };
}
inline auto one_of(std::vector<std::string> allowed) {
  return [allowed](const std::string& v) -> std::optional<std::string> {
    for (const auto& a : allowed)
      if (v == a) return std::nullopt;
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "\"" : ", \"") + a + "\"";
    return fmt::format("must be one of {}, found \"{}\"", list, v);
  };
}

// --set section.key=value into the parsed table; origins records where the key came from.
void apply_override(toml::table& root, const std::string& item, Origins& origins);

}  // namespace trainer::config_reader
