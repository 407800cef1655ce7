#pragma once
/// \file detail::check_trainable, detail::check_data: what DistributedDataParallel and a fully_shard unit check of
/// each parameter before a forward, since both fixed at wrapping which gradients they reduce and where the data lives.

#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/StringUtil.h>
#include <c10/util/accumulate.h>

#include "gradsync/core/error.hpp"

namespace gradsync::detail {

/// Throws InvalidArgument if parameter `name` (`p`) is frozen where it was
/// `trainable` when `wrapped` (the wrapping, in words), or the reverse:
/// which gradients are reduced is fixed then, as in PyTorch's DDP and FSDP.
inline void check_trainable(const std::string& where, const std::string& name, const at::Tensor& p, bool trainable,
                            std::string_view wrapped, std::string_view fix) {
  if (p.requires_grad() == trainable) return;
  auto state = [](bool t) {
    return std::string(t ? "trainable (requires_grad true)" : "frozen (requires_grad false)");
  };
  throw InvalidArgument(where + ": parameter '" + name + "' was " + state(trainable) + " " + std::string(wrapped) +
                        " and is now " + state(!trainable) + "; " + std::string(fix));
}

/// Throws InvalidArgument if parameter `name` (`p`) no longer has the shape,
/// data and contiguous layout the wrapper gave it or found (`shape`,
/// `data`; data and layout unchecked where `shape` holds no element):
/// torch::load and set_data replace them (a strided view of the same data,
/// say), after which the wrapper would reduce or gather what the module no
/// longer holds, or in another order. `after`: the wrapping, in words;
/// `consequence`: what would go wrong.
inline void check_data(const std::string& where, const std::string& name, const at::Tensor& p,
                       c10::IntArrayRef shape, const void* data, std::string_view after,
                       std::string_view consequence) {
  const bool same_shape = p.sizes().equals(shape);
  if (same_shape && (c10::multiply_integers(shape) == 0 || (p.data_ptr() == data && p.is_contiguous()))) return;
  const std::string what = !same_shape         ? "shape, from " + c10::str(shape) + " to " + c10::str(p.sizes())
                           : p.data_ptr() != data ? std::string("storage (torch::load or set_data replaced it)")
                                                  : std::string("layout: it is no longer contiguous (set_data "
                                                                "with a strided view)");
  throw InvalidArgument(where + ": parameter '" + name + "' changed " + what + " " + std::string(after) + "; " +
                        std::string(consequence));
}

}  // namespace gradsync::detail
