#pragma once
/// \file A tensor's name, dtype and full logical shape: what a checkpoint
/// file declares before any of its data is written.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gradsync/checkpoint/tensor_dtype.hpp"

namespace gradsync::checkpoint {

/// A tensor as a checkpoint declares it: row-major, unpadded, little-endian.
/// (gradsync::TensorSpec, the trainers' model protocol, has a name and shape
/// but no dtype; this is what a file records.)
struct TensorInfo {
  std::string name;
  TensorDtype dtype = TensorDtype::F32;
  std::vector<std::uint64_t> shape;

  /// Elements in the shape (1 for a scalar, shape {}), or nothing on overflow.
  std::optional<std::uint64_t> checked_elements() const noexcept {
    std::uint64_t n = 1;
    for (auto d : shape) {
      if (d != 0 && n > UINT64_MAX / d) return std::nullopt;
      n *= d;
    }
    return n;
  }

  /// Bytes of data, or nothing on overflow.
  std::optional<std::uint64_t> checked_bytes() const noexcept {
    auto n = checked_elements();
    if (!n || *n > UINT64_MAX / dtype_size(dtype)) return std::nullopt;
    return *n * dtype_size(dtype);
  }

  std::uint64_t elements() const noexcept { return checked_elements().value_or(0); }
  std::uint64_t bytes() const noexcept { return checked_bytes().value_or(0); }

  friend bool operator==(const TensorInfo&, const TensorInfo&) = default;
};

/// "[2, 3]", for messages.
inline std::string shape_string(const std::vector<std::uint64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace gradsync::checkpoint
