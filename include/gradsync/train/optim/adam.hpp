#pragma once
/// \file Adam, as PyTorch's torch.optim.Adam (weight decay as an L2 term in the gradient).

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "gradsync/train/optim/optimizer.hpp"
#include "gradsync/train/optim/optimizer_state_storage.hpp"

namespace gradsync {

/// Hyper-parameters of Adam and AdamW.
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  /// Adam: added to the gradient (L2). AdamW: decoupled, p *= 1 - lr * weight_decay.
  double weight_decay = 0;
};

namespace detail {

/// The moment update both Adam variants share; `decoupled` selects AdamW's
/// weight decay. Bias corrections are computed in double once per step.
template <class T>
void adam_step(const AdamOptions& o, bool decoupled, std::size_t t, std::span<T> p, std::span<const T> g,
               std::span<T> m, std::span<T> v) {
  const std::size_t n = p.size();
  const T b1 = static_cast<T>(o.beta1);
  const T b2 = static_cast<T>(o.beta2);
  const T lr = static_cast<T>(o.lr);
  const T wd = static_cast<T>(o.weight_decay);
  const T eps = static_cast<T>(o.eps);
  const T c1 = static_cast<T>(1 - std::pow(o.beta1, static_cast<double>(t)));
  const T sqrt_c2 = static_cast<T>(std::sqrt(1 - std::pow(o.beta2, static_cast<double>(t))));
  const T decay = static_cast<T>(1 - o.lr * o.weight_decay);
  for (std::size_t i = 0; i < n; ++i) {
    T gi = g[i];
    if (decoupled) {
      p[i] *= decay;
    } else {
      gi += wd * p[i];
    }
    m[i] = b1 * m[i] + (1 - b1) * gi;
    v[i] = b2 * v[i] + (1 - b2) * gi * gi;
    p[i] -= lr * (m[i] / c1) / (std::sqrt(v[i]) / sqrt_c2 + eps);
  }
}

}  // namespace detail

namespace detail {

/// Adam and AdamW: one class, since they differ only in where the weight
/// decay goes.
template <std::floating_point T, bool Decoupled>
class AdamImpl {
 public:
  using value_type = T;

  /// PyTorch's AdamW defaults weight_decay to 0.01 and Adam to 0; so do these.
  explicit AdamImpl(AdamOptions options = Decoupled ? AdamOptions{.weight_decay = 0.01} : AdamOptions{})
      : o_(options), moments_(2) {}

  double lr() const noexcept { return o_.lr; }
  void set_lr(double lr) noexcept { o_.lr = lr; }
  const AdamOptions& options() const noexcept { return o_; }
  /// State elements kept per parameter: the two moments.
  static constexpr std::size_t state_per_element() noexcept { return 2; }
  /// State elements held in the optimizer's own memory now (none before
  /// the first step, none once bound).
  std::size_t state_elements() const noexcept { return moments_.own_elements(); }

  /// Keeps the moments in `storage` (2·elements values: exp_avg, then
  /// exp_avg_sq) from now on, for steps on spans of `elements` parameters;
  /// the caller keeps it alive. A trainer that offloads its shards lends it
  /// this way. Moments held so far move there.
  void bind_state(std::span<T> storage, std::size_t elements) { moments_.bind(name(), storage, elements); }

  /// Forgets the moments and the step count (bound: zeroes them; the size
  /// stays the bound one).
  void reset() noexcept {
    moments_.clear();
    t_ = 0;
  }

  /// For checkpoints: steps, the hyper-parameters (lr, beta1, beta2, eps,
  /// weight_decay) and the moments exp_avg and exp_avg_sq.
  OptimizerStateView<T> state() const {
    return {Decoupled ? "AdamW" : "Adam",
            t_,
            {{"lr", o_.lr}, {"beta1", o_.beta1}, {"beta2", o_.beta2}, {"eps", o_.eps},
             {"weight_decay", o_.weight_decay}},
            {{"exp_avg", moments_.buffer(0)}, {"exp_avg_sq", moments_.buffer(1)}}};
  }

  /// Throws InvalidArgument unless `s` holds five hyper-parameters and two buffers.
  void check_state(const OptimizerState<T>& s) const {
    check_state_shape(name(), s, 5, 2);
    moments_.check_assign(name(), s.buffers);
  }

  /// Restores what state() lists, in its order, after check_state.
  void load_state(OptimizerState<T> s) {
    check_state(s);
    const auto& h = s.hyperparameters;
    o_ = {.lr = h[0], .beta1 = h[1], .beta2 = h[2], .eps = h[3], .weight_decay = h[4]};
    moments_.assign(std::move(s.buffers));
    t_ = static_cast<std::size_t>(s.steps);
  }

  void step(std::span<T> params, std::span<const T> grads) {
    check_step_sizes(name(), params.size(), grads.size(), moments_.size());
    if (moments_.size() == 0) moments_.zero(params.size());
    adam_step(o_, Decoupled, ++t_, params, grads, moments_.buffer(0), moments_.buffer(1));
  }

 private:
  static constexpr const char* name() noexcept { return Decoupled ? "AdamW" : "Adam"; }

  AdamOptions o_;
  /// exp_avg (m) and exp_avg_sq (v).
  OptimizerStateStorage<T> moments_;
  std::size_t t_ = 0;
};

}  // namespace detail

/// Adam on flat spans; weight decay, if any, is added to the gradient (L2).
template <std::floating_point T = float>
using Adam = detail::AdamImpl<T, false>;

}  // namespace gradsync
