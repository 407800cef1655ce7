#pragma once
/// \file LibTorch tensors as gradsync buffers: dtype mapping and checked, copy-free spans.
///
/// Part of the opt-in LibTorch integration (gradsync/integration/torch.hpp):
/// the umbrella header gradsync/gradsync.hpp never includes torch.

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>

// The tensor type alone (torch::Tensor is at::Tensor): 2 s to parse, where
// <torch/torch.h> takes 16 s.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/float16.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync {

/// The gradsync element type of a torch dtype, or nothing where gradsync has
/// none (bool, uint8, complex...). bfloat16 and half have the same 16-bit
/// layout in both libraries, so their memory is shared as is.
inline std::optional<DataType> data_type_of(c10::ScalarType t) noexcept {
  switch (t) {
    case c10::ScalarType::Float: return DataType::float32;
    case c10::ScalarType::Double: return DataType::float64;
    case c10::ScalarType::Int: return DataType::int32;
    case c10::ScalarType::Long: return DataType::int64;
    case c10::ScalarType::BFloat16: return DataType::bfloat16;
    case c10::ScalarType::Half: return DataType::float16;
    default: return std::nullopt;
  }
}

namespace detail {

/// Why `t` cannot be handed to a host collective as one span, or empty.
inline std::string unusable_reason(const at::Tensor& t) {
  if (!t.defined()) return "it is undefined";
  if (!t.is_contiguous()) return "it is not contiguous (call .contiguous() on it, or make the module's tensors contiguous)";
  if (!t.device().is_cpu()) return "it is on " + t.device().str() + ", and this backend moves host memory (CPU tensors)";
  if (!data_type_of(t.scalar_type())) return std::string("its dtype ") + c10::toString(t.scalar_type()) +
                                             " has no gradsync element type (float, double, int32, int64, bfloat16, half)";
  return {};
}

/// The elements of `t` as a span of T, unchecked: for a tensor known to be
/// contiguous, on the CPU and of T's dtype (one gradsync made, or checked).
template <class T>
std::span<T> span_of(const at::Tensor& t) {
  return {static_cast<T*>(t.data_ptr()), static_cast<std::size_t>(t.numel())};
}

}  // namespace detail

/// The elements of the CPU tensor `t` as a span of T, without a copy: the
/// collectives then work in the tensor's own memory. Throws InvalidArgument
/// naming `what` if `t` is not contiguous, not on the CPU, or not of T's
/// dtype.
template <class T>
std::span<T> tensor_span(const at::Tensor& t, std::string_view what = "tensor") {
  std::string why = detail::unusable_reason(t);
  if (why.empty() && *data_type_of(t.scalar_type()) != DataTypeOf<T>::value) {
    why = std::string("its dtype is ") + c10::toString(t.scalar_type()) + ", not the one asked for";
  }
  if (!why.empty()) throw InvalidArgument("gradsync: cannot use " + std::string(what) + " as a buffer: " + why);
  return detail::span_of<T>(t);
}

}  // namespace gradsync
