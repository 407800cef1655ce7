#pragma once
/// \file AdamW: Adam with decoupled weight decay, as PyTorch's torch.optim.AdamW.

#include <concepts>

#include "gradsync/train/optim/adam.hpp"
#include "gradsync/train/optim/optimizer.hpp"

namespace gradsync {

/// AdamW on flat spans: p *= 1 - lr * weight_decay, then the Adam update.
/// PyTorch's AdamW defaults weight_decay to 0.01; so does this.
template <std::floating_point T = float>
using AdamW = detail::AdamImpl<T, true>;

}  // namespace gradsync
