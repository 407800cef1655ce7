#pragma once
// What two_tu_a.cpp and two_tu_b.cpp each do with the library, each TU with
// its own algorithm and value, so that both hold instantiations of the same
// headers: a bfloat16 round trip and an all-reduce on 2 threads.
#include <gradsync/gradsync.hpp>

#include <span>
#include <vector>

/// 0 if `value` survives bfloat16 and an all-reduce by `Algorithm` runs, else 1.
template <class Algorithm>
int use_library(float value) {
  gradsync::bfloat16 half(value);
  if (static_cast<float>(half) != value) return 1;
  gradsync::run_threads(2, [](auto& comm) {
    std::vector<float> x(3, 1.0f);
    gradsync::AllReduce<Algorithm>{}(comm, std::span<float>(x));
  });
  return 0;
}
