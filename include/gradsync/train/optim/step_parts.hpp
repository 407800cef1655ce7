#pragma once
/// \file for_step_parts: an optimizer step split over threads, when its options ask for more than one.

#include <algorithm>
#include <cstddef>
#include <system_error>
#include <thread>
#include <vector>

namespace gradsync::detail {

/// Fewest elements a thread of a step takes: below this, starting a thread
/// (tens of µs) costs more than the part's share of the memory traffic.
inline constexpr std::size_t min_step_part = std::size_t{1} << 16;

/// Runs f(begin, end) over [0, n) in up to `threads` contiguous parts, each
/// a multiple of `block` elements (the last takes the rest) and at least
/// min_step_part long; the calling thread takes the first part and joins
/// the others. A part whose thread cannot start runs on the caller. Each
/// element's update depends on that element alone, so results are bitwise
/// those of one part.
template <class F>
void for_step_parts(std::size_t n, unsigned threads, std::size_t block, F&& f) {
  const std::size_t most = std::max<std::size_t>(1, n / min_step_part);
  const std::size_t parts = std::min<std::size_t>(std::max(1u, threads), most);
  if (parts == 1) {
    f(std::size_t{0}, n);
    return;
  }
  // Whole blocks per part, so that only the last one has a tail.
  const std::size_t per = (n / parts + block - 1) / block * block;
  std::vector<std::jthread> helpers;
  helpers.reserve(parts - 1);
  for (std::size_t k = 1; k < parts; ++k) {
    const std::size_t b = std::min(n, k * per), e = k + 1 == parts ? n : std::min(n, (k + 1) * per);
    if (b >= e) continue;
    try {
      helpers.emplace_back([&f, b, e] { f(b, e); });
    } catch (const std::system_error&) {
      f(b, e);
    }
  }
  f(std::size_t{0}, std::min(n, per));
}

}  // namespace gradsync::detail
