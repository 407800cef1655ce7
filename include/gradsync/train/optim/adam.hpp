#pragma once
/// \file Adam, as PyTorch's torch.optim.Adam (weight decay as an L2 term in the gradient).

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/core/ops.hpp"
#include "gradsync/train/optim/optimizer.hpp"
#include "gradsync/train/optim/optimizer_state_storage.hpp"
#include "gradsync/train/optim/sqrt_in_place.hpp"
#include "gradsync/train/optim/step_parts.hpp"

namespace gradsync {

/// Hyper-parameters of Adam and AdamW.
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  /// Adam: added to the gradient (L2). AdamW: decoupled, p *= 1 - lr * weight_decay.
  double weight_decay = 0;
  /// Threads that share a step, for a trainer with idle cores: 1 (the
  /// default, since ranks usually own the cores) steps on the caller alone.
  /// More split a step of at least 2 x 64 Ki elements into contiguous parts
  /// (detail::for_step_parts); results are bitwise the same. Not a
  /// hyper-parameter: checkpoints and the ranks' agreement leave it out.
  unsigned threads = 1;
};

namespace detail {

/// Throws InvalidArgument unless `o` is what torch.optim.Adam and AdamW
/// accept, all finite: lr, eps and weight_decay not negative, each beta in
/// [0, 1) (beta1 = 1 divides by a zero bias correction; above 1 the
/// averages grow without bound).
inline const AdamOptions& checked(const char* who, const AdamOptions& o) {
  check_hyperparameter(who, "lr", o.lr, 0);
  check_hyperparameter(who, "beta1", o.beta1, 0, 1);
  check_hyperparameter(who, "beta2", o.beta2, 0, 1);
  check_hyperparameter(who, "eps", o.eps, 0);
  check_hyperparameter(who, "weight_decay", o.weight_decay, 0);
  return o;
}

/// Adam's per-step constants, computed in double once per step and rounded
/// once to T, so the per-element loop holds no division by a bias correction.
///
/// torch.optim.Adam steps p -= (lr / c1) * m / (sqrt(v) / sqrt(c2) + eps),
/// with c1 = 1 - beta1^t and c2 = 1 - beta2^t. Multiplying the fraction's
/// numerator and denominator by sqrt(c2) gives the same update as
/// p -= step_size * m / (sqrt(v) + eps_hat), step_size = lr * sqrt(c2) / c1,
/// eps_hat = eps * sqrt(c2) (Kingma and Ba's remark under their Algorithm 1):
/// one sqrt and one division per element instead of three divisions.
/// PyTorch's loops keep the unfolded denominator; results differ from it only
/// by rounding (a few ulp of p after some steps; the tests' reference loop bounds it).
template <class T>
struct AdamStepConstants {
  T beta1, one_minus_beta1, beta2, one_minus_beta2;
  /// Adam: the L2 term's factor. AdamW: p *= decay = 1 - lr * weight_decay.
  T weight_decay, decay;
  T step_size, eps_hat;

  AdamStepConstants(const AdamOptions& o, std::size_t t)
      : beta1(static_cast<T>(o.beta1)),
        one_minus_beta1(1 - beta1),
        beta2(static_cast<T>(o.beta2)),
        one_minus_beta2(1 - beta2),
        weight_decay(static_cast<T>(o.weight_decay)),
        decay(static_cast<T>(1 - o.lr * o.weight_decay)) {
    const double c1 = 1 - std::pow(o.beta1, static_cast<double>(t));
    const double sqrt_c2 = std::sqrt(1 - std::pow(o.beta2, static_cast<double>(t)));
    step_size = static_cast<T>(o.lr * sqrt_c2 / c1);
    eps_hat = static_cast<T>(o.eps * sqrt_c2);
  }
};

/// Adam on `len` elements: the moments and sqrt(v) first, then p. `Len` is
/// std::integral_constant for whole blocks, so their loops have a known trip
/// count and vectorize at -O2 (see for_each_blocked), and their square roots
/// go through sqrt_in_place (why: there); std::size_t for the tail.
template <bool Decoupled, class T, class Len>
void adam_block(const AdamStepConstants<T>& k, T* __restrict p, const T* __restrict g, T* __restrict m,
                T* __restrict v, Len len) noexcept {
  T root[simd_block<T>];
  for (std::size_t j = 0; j < len; ++j) {
    T gj = g[j];
    if constexpr (!Decoupled) gj += k.weight_decay * p[j];
    m[j] = k.beta1 * m[j] + k.one_minus_beta1 * gj;
    v[j] = k.beta2 * v[j] + k.one_minus_beta2 * gj * gj;
    root[j] = v[j];
  }
  if constexpr (std::is_same_v<Len, std::size_t>) {
    for (std::size_t j = 0; j < len; ++j) root[j] = std::sqrt(root[j]);
  } else {
    sqrt_in_place<T, Len::value>(root);
  }
  for (std::size_t j = 0; j < len; ++j) {
    T pj = p[j];
    if constexpr (Decoupled) pj *= k.decay;
    p[j] = pj - k.step_size * m[j] / (root[j] + k.eps_hat);
  }
}

/// One Adam (or, `Decoupled`, AdamW) step at step count t over p, g and the
/// moments m and v, which must not overlap. Out of line as Sgd's steps are (see sgd_plain_step).
template <bool Decoupled, class T>
[[gnu::noinline]] void adam_step(const AdamOptions& o, std::size_t t, T* __restrict p, const T* __restrict g,
                                 T* __restrict m, T* __restrict v, std::size_t n) noexcept {
  const AdamStepConstants<T> k(o, t);
  constexpr std::size_t w = simd_block<T>;
  std::size_t i = 0;
  for (; i + w <= n; i += w) {
    adam_block<Decoupled>(k, p + i, g + i, m + i, v + i, std::integral_constant<std::size_t, w>{});
  }
  adam_block<Decoupled>(k, p + i, g + i, m + i, v + i, n - i);
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
      : o_(checked(name(), options)), moments_(2) {}

  double lr() const noexcept { return o_.lr; }
  /// Throws InvalidArgument unless `lr` is finite and not negative.
  void set_lr(double lr) {
    check_hyperparameter(name(), "lr", lr, 0);
    o_.lr = lr;
  }
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

  /// Throws InvalidArgument unless `s` holds five hyper-parameters that the
  /// constructor would accept and two buffers, which a state that has taken
  /// steps holds.
  void check_state(const OptimizerState<T>& s) const {
    check_state_shape(name(), s, 5, 2);
    moments_.check_assign(name(), s.buffers);
    checked(name(), options_of(s));
  }

  /// Restores what state() lists, in its order, after check_state.
  void load_state(OptimizerState<T> s) {
    check_state(s);
    o_ = options_of(s);
    moments_.assign(std::move(s.buffers));
    t_ = static_cast<std::size_t>(s.steps);
  }

  /// A step on no elements changes nothing and is not counted: counted, it
  /// would move the bias correction of the first real step.
  void step(std::span<T> params, std::span<const T> grads) {
    check_step_sizes(name(), params.size(), grads.size(), moments_.size(), moments_.bound());
    if (params.empty()) return;
    if (moments_.size() == 0) moments_.zero(params.size());
    const std::size_t t = ++t_;
    T *p = params.data(), *m = moments_.buffer(0).data(), *v = moments_.buffer(1).data();
    const T* g = grads.data();
    for_step_parts(params.size(), o_.threads, simd_block<T>, [&](std::size_t b, std::size_t e) {
      adam_step<Decoupled>(o_, t, p + b, g + b, m + b, v + b, e - b);
    });
  }

 private:
  static constexpr const char* name() noexcept { return Decoupled ? "AdamW" : "Adam"; }
  /// The options a state's hyper-parameters (state()'s order) stand for.
  AdamOptions options_of(const OptimizerState<T>& s) const {
    const auto& h = s.hyperparameters;
    return {.lr = h[0], .beta1 = h[1], .beta2 = h[2], .eps = h[3], .weight_decay = h[4], .threads = o_.threads};
  }

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
