#pragma once
// A share of a case's option combinations, for the sanitizer builds.

#include <cstddef>
#include <string>
#include <string_view>

#include "common.hpp"
#include "sanitizers.hpp"

namespace test {

/// Under a sanitizer, a case that walks many option combinations runs one in
/// `period` of them, a different share each run: the phase comes from the
/// run's seed and the case's salt, so successive runs cover them all and a
/// failing run replays with its seed. The plain build runs every one. Ask
/// keep() once per combination, in a fixed order.
class SanitizerSample {
 public:
  SanitizerSample(std::string_view salt, std::size_t period)
      : period_(period), phase_(rng_for(std::string(salt) + "/sample")() % period) {}

  bool keep() noexcept { return !sanitized || next_++ % period_ == phase_; }

 private:
  std::size_t period_;
  std::size_t phase_;
  std::size_t next_ = 0;
};

}  // namespace test
