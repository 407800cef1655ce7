#pragma once
/// \file cost_model<B>(): the cost model a backend runs with, and the
/// GRADSYNC_COST_MODEL reader that overrides its constants.

#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <string_view>

#include "gradsync/core/cost_model.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync {

namespace detail {

/// Reads "alpha=..,beta=..,gamma=..,native_alpha=..,native_beta=..,chunk_bytes=..,
/// eager_bytes=..,rendezvous_alpha=.." over a model; unknown keys are an
/// error so that a typo is not silently ignored.
inline CostModel parse_cost_model(std::string_view text, CostModel m) {
  while (!text.empty()) {
    const std::size_t comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
    if (item.empty()) continue;
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL expects key=value, got '" + std::string(item) + "'");
    const std::string key(item.substr(0, eq));
    const std::string value(item.substr(eq + 1));
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (end == value.c_str() || *end != '\0') throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL: '" + value + "' is not a number");
    // Times are finite and non-negative; a chunk is a whole number of bytes
    // from 1 up to 1 TiB (beyond that it would not fit a size_t cast safely).
    if (!std::isfinite(v) || v < 0) {
      throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL: " + key + " must be a finite number >= 0, got '" + value + "'");
    }
    if (key == "alpha") m.alpha = v;
    else if (key == "beta") m.beta = v;
    else if (key == "gamma") m.gamma = v;
    else if (key == "native_alpha") m.native_alpha = v;
    else if (key == "native_beta") m.native_beta = v;
    else if (key == "rendezvous_alpha") m.rendezvous_alpha = v;
    else if (key == "chunk_bytes") {
      if (v < 1 || v > 1099511627776.0 || v != std::floor(v)) {
        throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL: chunk_bytes must be a whole number of bytes in [1, 2^40], got '" + value + "'");
      }
      m.chunk_bytes = static_cast<std::size_t>(v);
    }
    else if (key == "eager_bytes") {
      if (v > 1099511627776.0 || v != std::floor(v)) {
        throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL: eager_bytes must be a whole number of bytes in [0, 2^40], got '" + value + "'");
      }
      m.eager_bytes = static_cast<std::size_t>(v);
    }
    else throw InvalidArgument("gradsync: GRADSYNC_COST_MODEL: unknown key '" + key + "' (expected alpha, beta, gamma, native_alpha, native_beta, chunk_bytes, eager_bytes, rendezvous_alpha)");
  }
  return m;
}

}  // namespace detail

/// The cost model backend B runs with, for Auto's choice and for the
/// algorithms that pick a variant by size: B::cost_model (CostModel{} for a
/// backend without one), overridden by the environment variable
/// GRADSYNC_COST_MODEL (as written by bench/calibrate). Read once per
/// process, so every call, and every rank given the same environment,
/// decides from the same numbers.
template <class B>
const CostModel& cost_model() {
  static const CostModel model = [] {
    CostModel base{};
    // Tuning data with a default, not an ability: a backend's cost model
    // lives on its policy (STYLE 4), so it is no Capabilities flag.
    if constexpr (requires { B::cost_model; }) base = B::cost_model;
    const char* env = std::getenv("GRADSYNC_COST_MODEL");
    return env ? detail::parse_cost_model(env, base) : base;
  }();
  return model;
}

}  // namespace gradsync
