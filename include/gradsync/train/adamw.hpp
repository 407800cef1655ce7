#pragma once
/// \file AdamW: Adam with decoupled weight decay, as PyTorch's torch.optim.AdamW.

#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

#include "gradsync/train/adam.hpp"
#include "gradsync/train/optimizer.hpp"

namespace gradsync {

/// AdamW on flat spans: p *= 1 - lr * weight_decay, then the Adam update.
/// PyTorch's AdamW defaults weight_decay to 0.01; so does this.
template <std::floating_point T = float>
class AdamW {
 public:
  using value_type = T;

  explicit AdamW(AdamOptions options = {.weight_decay = 0.01}) : o_(options) {}

  double lr() const noexcept { return o_.lr; }
  void set_lr(double lr) noexcept { o_.lr = lr; }
  const AdamOptions& options() const noexcept { return o_; }

  void reset() noexcept {
    m_.clear();
    v_.clear();
    t_ = 0;
  }

  void step(std::span<T> params, std::span<const T> grads) {
    detail::check_step_sizes("AdamW", params.size(), grads.size(), m_.size());
    if (m_.empty()) {
      m_.assign(params.size(), T(0));
      v_.assign(params.size(), T(0));
    }
    detail::adam_step(o_, true, ++t_, params, grads, m_, v_);
  }

 private:
  AdamOptions o_;
  std::vector<T> m_, v_;
  std::size_t t_ = 0;
};

}  // namespace gradsync
