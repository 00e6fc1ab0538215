#include "io/toml_reader.h"

namespace trainer::config_reader {

const char* type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::table:
      return "a table";
    default:
      return "a date/time";
  }
}

void apply_override(toml::table& root, const std::string& item, Origins& origins) {
  const std::string origin = "--set " + item;
  const size_t eq = item.find('=');
  // The key is after the last dot before '=': "comm.compression.method=topk" sets `method` in
  // [comm.compression].
  const size_t dot = eq == std::string::npos ? std::string::npos : item.rfind('.', eq);
  if (eq == std::string::npos || dot == std::string::npos || dot == 0 || dot + 1 == eq)
    throw ConfigError(fmt::format("{}: expected section.key=value", origin));
  const std::string section = item.substr(0, dot), key = item.substr(dot + 1, eq - dot - 1);
  const std::string value = item.substr(eq + 1);
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    parsed.insert_or_assign("v", value);  // a bare word: take it as a string
  }
  toml::table* table = &root;
  for (size_t start = 0; start <= section.size();) {  // each part of the dotted section
    const size_t end = std::min(section.find('.', start), section.size());
    const std::string part = section.substr(start, end - start);
    if (!table->get(part)) table->insert_or_assign(part, toml::table{});
    table = table->get(part)->as_table();
    if (!table) throw ConfigError(fmt::format("{}: [{}] is not a table", origin, section));
    start = end + 1;
  }
  table->insert_or_assign(key, std::move(*parsed.get("v")));
  origins[section + "." + key] = origin;
}

}  // namespace trainer::config_reader
