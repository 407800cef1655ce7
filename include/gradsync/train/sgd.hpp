#pragma once
/// \file Sgd: stochastic gradient descent, with optional momentum, as PyTorch's torch.optim.SGD.

#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

#include "gradsync/train/optimizer.hpp"

namespace gradsync {

/// Hyper-parameters of Sgd; the defaults are plain SGD.
struct SgdOptions {
  double lr = 0.01;
  /// 0 is plain SGD; otherwise the velocity v = momentum * v + (1 - dampening) * g.
  double momentum = 0;
  double dampening = 0;
  /// L2 penalty added to the gradient: g += weight_decay * p.
  double weight_decay = 0;
  /// Step along g + momentum * v instead of v.
  bool nesterov = false;
};

/// SGD on flat spans. With momentum the first step sets v = g, as PyTorch does.
template <std::floating_point T = float>
class Sgd {
 public:
  using value_type = T;

  explicit Sgd(SgdOptions options = {}) : o_(options) {}

  double lr() const noexcept { return o_.lr; }
  void set_lr(double lr) noexcept { o_.lr = lr; }
  const SgdOptions& options() const noexcept { return o_; }
  /// State elements kept per parameter: the velocity, with momentum.
  std::size_t state_per_element() const noexcept { return o_.momentum == 0 ? 0 : 1; }
  /// State elements held now (none before the first step).
  std::size_t state_elements() const noexcept { return velocity_.size(); }

  /// Forgets the momentum, so the next step may be on a span of any size.
  void reset() noexcept {
    velocity_.clear();
    steps_ = 0;
  }

  void step(std::span<T> params, std::span<const T> grads) {
    detail::check_step_sizes("Sgd", params.size(), grads.size(), velocity_.size());
    const T lr = static_cast<T>(o_.lr);
    const T wd = static_cast<T>(o_.weight_decay);
    const std::size_t n = params.size();
    if (o_.momentum == 0) {
      for (std::size_t i = 0; i < n; ++i) params[i] -= lr * (grads[i] + wd * params[i]);
      ++steps_;
      return;
    }
    const T mu = static_cast<T>(o_.momentum);
    const T keep = static_cast<T>(1 - o_.dampening);
    const bool first = steps_ == 0;
    if (first) velocity_.assign(n, T(0));
    T* v = velocity_.data();
    for (std::size_t i = 0; i < n; ++i) {
      const T g = grads[i] + wd * params[i];
      v[i] = first ? g : mu * v[i] + keep * g;
      params[i] -= lr * (o_.nesterov ? g + mu * v[i] : v[i]);
    }
    ++steps_;
  }

 private:
  SgdOptions o_;
  std::vector<T> velocity_;
  std::size_t steps_ = 0;
};

}  // namespace gradsync
