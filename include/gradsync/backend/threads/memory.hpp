#pragma once
/// \file How the in-process transport moves and combines bytes: host memory
/// by default, swappable so that one transport serves other memories too.

#include <cstddef>
#include <cstring>

#include "gradsync/core/local_reduce.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync::detail::threads {

/// How bytes move and combine. Host memory by default; a test backend
/// that keeps ranks' buffers in one GPU's memory swaps in device copies
/// and kernels, and reuses this transport's matching unchanged.
struct Memory {
  void (*copy)(void* dst, const void* src, std::size_t bytes) = [](void* d, const void* s, std::size_t n) {
    std::memcpy(d, s, n);
  };
  void (*reduce)(DataType, OpKind, void*, const void*, std::size_t) = &reduce_into_erased;
  void (*finish)(DataType, OpKind, void*, std::size_t, int) = &finish_erased;
};

}  // namespace gradsync::detail::threads
