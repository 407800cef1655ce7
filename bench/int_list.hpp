#pragma once
// The bench tools' lists of positive integers on the command line
// ("--ranks 2,4,8", "--sizes 784,1024,10").

#include "../examples/parse_number.hpp"

#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

/// Positive integers, comma-separated; otherwise throws
/// std::invalid_argument naming `option` and the item.
inline std::vector<int> parse_list(const std::string& text, const char* option) {
  std::vector<int> out;
  std::stringstream ss(text);
  for (std::string t; std::getline(ss, t, ',');) {
    const std::optional<int> v = example::parse_whole<int>(t);
    if (!v || *v < 1) throw std::invalid_argument(std::string(option) + " " + t);
    out.push_back(*v);
  }
  if (out.empty()) throw std::invalid_argument(option);
  return out;
}

}  // namespace bench
