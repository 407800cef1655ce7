#pragma once
/// \file Sgd: stochastic gradient descent, with optional momentum, as PyTorch's torch.optim.SGD.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/core/ops.hpp"
#include "gradsync/train/optim/optimizer.hpp"
#include "gradsync/train/optim/optimizer_state_storage.hpp"
#include "gradsync/train/optim/step_parts.hpp"

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
  /// Threads that share a step (see AdamOptions::threads): 1 by default;
  /// results are bitwise the same. Not a hyper-parameter.
  unsigned threads = 1;
};

namespace detail {

/// Throws InvalidArgument unless `o` is what torch.optim.SGD accepts, all
/// finite: lr, momentum and weight_decay not negative, and nesterov only
/// with momentum and no dampening (where it would otherwise be ignored, or
/// step along a dampened velocity that PyTorch never takes).
inline const SgdOptions& checked(const SgdOptions& o) {
  check_hyperparameter("Sgd", "lr", o.lr, 0);
  check_hyperparameter("Sgd", "momentum", o.momentum, 0);
  check_hyperparameter("Sgd", "dampening", o.dampening, -std::numeric_limits<double>::max(),
                       std::numeric_limits<double>::max(), false);
  check_hyperparameter("Sgd", "weight_decay", o.weight_decay, 0);
  if (o.nesterov && (o.momentum == 0 || o.dampening != 0)) {
    throw InvalidArgument("gradsync: Sgd's nesterov needs a positive momentum and zero dampening, got momentum " +
                          std::to_string(o.momentum) + " and dampening " + std::to_string(o.dampening));
  }
  return o;
}

/// Plain SGD: p -= lr * (g + weight_decay * p), in blocks that vectorize at -O2.
///
/// Why noinline (here and on the other steps): inlined into a caller, GCC 12
/// lost the parameters' __restrict and kept the loop scalar (plain SGD at
/// 0.61-0.69 of memcpy's bandwidth, bench/optim_step); out of line, one call
/// per step, it vectorizes.
template <class T>
[[gnu::noinline]] void sgd_plain_step(const SgdOptions& o, T* __restrict p, const T* __restrict g, std::size_t n) noexcept {
  const T lr = static_cast<T>(o.lr);
  const T wd = static_cast<T>(o.weight_decay);
  for_each_blocked<T>(n, [=](std::size_t i) { p[i] -= lr * (g[i] + wd * p[i]); });
}

/// SGD with momentum: v = g on the first step (`First`), else
/// v = momentum * v + (1 - dampening) * g; then p -= lr * v, or with
/// `Nesterov` p -= lr * (g + momentum * v); g includes the weight decay.
template <bool First, bool Nesterov, class T>
[[gnu::noinline]] void sgd_momentum_step(const SgdOptions& o, T* __restrict p, const T* __restrict g, T* __restrict v,
                       std::size_t n) noexcept {
  const T lr = static_cast<T>(o.lr);
  const T wd = static_cast<T>(o.weight_decay);
  const T mu = static_cast<T>(o.momentum);
  const T keep = static_cast<T>(1 - o.dampening);
  for_each_blocked<T>(n, [=](std::size_t i) {
    const T gi = g[i] + wd * p[i];
    if constexpr (First) {
      v[i] = gi;
    } else {
      v[i] = mu * v[i] + keep * gi;
    }
    if constexpr (Nesterov) {
      p[i] -= lr * (gi + mu * v[i]);
    } else {
      p[i] -= lr * v[i];
    }
  });
}

}  // namespace detail

/// SGD on flat spans. With momentum the first step sets v = g, as PyTorch does.
template <std::floating_point T = float>
class Sgd {
 public:
  using value_type = T;

  /// Throws InvalidArgument on options torch.optim.SGD refuses (detail::checked).
  explicit Sgd(SgdOptions options = {})
      : o_(detail::checked(options)), velocity_(options.momentum == 0 ? 0 : 1) {}

  double lr() const noexcept { return o_.lr; }
  /// Throws InvalidArgument unless `lr` is finite and not negative.
  void set_lr(double lr) {
    detail::check_hyperparameter("Sgd", "lr", lr, 0);
    o_.lr = lr;
  }
  const SgdOptions& options() const noexcept { return o_; }
  /// State elements kept per parameter: the velocity, with momentum.
  std::size_t state_per_element() const noexcept { return o_.momentum == 0 ? 0 : 1; }
  /// State elements held in the optimizer's own memory now (none before
  /// the first step, none once bound).
  std::size_t state_elements() const noexcept { return velocity_.own_elements(); }

  /// Keeps the velocity in `storage` (state_per_element()·elements values,
  /// none without momentum) from now on, for steps on spans of `elements`
  /// parameters; the caller keeps it alive. A trainer that offloads its
  /// shards lends it this way. A velocity held so far moves there.
  void bind_state(std::span<T> storage, std::size_t elements) { velocity_.bind("Sgd", storage, elements); }

  /// Forgets the momentum, so the next step may be on a span of any size
  /// (bound: zeroes it; the size stays the bound one).
  void reset() noexcept {
    velocity_.clear();
    steps_ = 0;
  }

  /// For checkpoints: steps, the hyper-parameters (lr, momentum,
  /// dampening, weight_decay, nesterov) and, with momentum, momentum_buffer.
  OptimizerStateView<T> state() const {
    OptimizerStateView<T> s{"Sgd", steps_, {}, {}};
    s.hyperparameters = {{"lr", o_.lr},
                         {"momentum", o_.momentum},
                         {"dampening", o_.dampening},
                         {"weight_decay", o_.weight_decay},
                         {"nesterov", o_.nesterov ? 1.0 : 0.0}};
    if (o_.momentum != 0) s.buffers.emplace_back("momentum_buffer", velocity_.buffer(0));
    return s;
  }

  /// Throws InvalidArgument if `s` is not what state() lists for this
  /// optimizer: five hyper-parameters that the constructor would accept
  /// and, with momentum (and only then), one buffer, which a state that
  /// has taken steps holds.
  void check_state(const OptimizerState<T>& s) const {
    detail::check_state_shape("Sgd", s, 5, o_.momentum == 0 ? 0 : 1);
    velocity_.check_assign("Sgd", s.buffers);
    detail::checked(options_of(s));
    if ((s.hyperparameters[1] == 0) != (o_.momentum == 0)) {
      throw InvalidArgument("gradsync: Sgd::load_state: momentum " + std::to_string(s.hyperparameters[1]) +
                            (o_.momentum == 0 ? " into an Sgd without momentum" : " into an Sgd with momentum") +
                            "; the momentum buffer would be missing or left over");
    }
  }

  /// Restores what state() lists, in its order, after check_state. A
  /// buffer loaded before the first step is ignored: that step sets the
  /// velocity to the gradient.
  void load_state(OptimizerState<T> s) {
    check_state(s);
    o_ = options_of(s);
    velocity_.assign(std::move(s.buffers));
    steps_ = static_cast<std::size_t>(s.steps);
  }

  /// A step on no elements changes nothing and is not counted: it would
  /// leave a momentum of no elements for the first real step to read.
  void step(std::span<T> params, std::span<const T> grads) {
    detail::check_step_sizes("Sgd", params.size(), grads.size(), velocity_.size(), velocity_.bound());
    const std::size_t n = params.size();
    if (n == 0) return;
    T* p = params.data();
    const T* g = grads.data();
    if (o_.momentum == 0) {
      detail::for_step_parts(n, o_.threads, detail::simd_block<T>, [&](std::size_t b, std::size_t e) {
        detail::sgd_plain_step(o_, p + b, g + b, e - b);
      });
    } else {
      const bool first = steps_ == 0;
      if (first) velocity_.zero(n);
      T* v = velocity_.buffer(0).data();
      // Each option its own loop, so none branches per element.
      detail::for_step_parts(n, o_.threads, detail::simd_block<T>, [&](std::size_t b, std::size_t e) {
        if (first) {
          o_.nesterov ? detail::sgd_momentum_step<true, true>(o_, p + b, g + b, v + b, e - b)
                      : detail::sgd_momentum_step<true, false>(o_, p + b, g + b, v + b, e - b);
        } else {
          o_.nesterov ? detail::sgd_momentum_step<false, true>(o_, p + b, g + b, v + b, e - b)
                      : detail::sgd_momentum_step<false, false>(o_, p + b, g + b, v + b, e - b);
        }
      });
    }
    ++steps_;
  }

 private:
  /// The options a state's hyper-parameters (state()'s order) stand for.
  SgdOptions options_of(const OptimizerState<T>& s) const {
    const auto& h = s.hyperparameters;
    return {.lr = h[0], .momentum = h[1], .dampening = h[2], .weight_decay = h[3], .nesterov = h[4] != 0,
            .threads = o_.threads};
  }

  SgdOptions o_;
  /// The velocity (one slot), with momentum; no slots without.
  detail::OptimizerStateStorage<T> velocity_;
  std::size_t steps_ = 0;
};

}  // namespace gradsync
