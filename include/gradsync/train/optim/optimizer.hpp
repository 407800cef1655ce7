#pragma once
/// \file What a trainer asks of an optimizer: a step on flat spans.

#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/core/error.hpp"

namespace gradsync {

/// An optimizer for elements of type T: `step(params, grads)` updates one
/// flat span of parameters from the matching span of gradients, and keeps
/// whatever state it needs (momentum, moments) for exactly that span. A
/// replicated trainer passes the whole model; a sharded one its 1/N shard.
/// `lr()` and `set_lr(double)` let a schedule or the scaling rule set the
/// learning rate.
template <class O, class T>
concept Optimizer = requires(O& o, const O& co, std::span<T> params, std::span<const T> grads, double lr) {
  o.step(params, grads);
  { co.lr() } -> std::convertible_to<double>;
  o.set_lr(lr);
};

/// What an optimizer must save to continue exactly, as it holds it: spans
/// into the optimizer, valid until its next step or load_state. A
/// checkpoint names each buffer after the tensors of the flat span it
/// covers (`optimizer.fc1.weight.exp_avg`).
template <class T>
struct OptimizerStateView {
  /// "Sgd", "Adam", "AdamW": a checkpoint of one kind does not load into another.
  std::string_view kind;
  /// Steps taken (Adam's bias correction; Sgd's first-step momentum rule).
  std::uint64_t steps = 0;
  /// Name and value of every hyper-parameter, booleans as 0 or 1.
  std::vector<std::pair<std::string_view, double>> hyperparameters;
  /// Name (PyTorch's: momentum_buffer, exp_avg, exp_avg_sq) and data of
  /// every per-element buffer: as long as the span stepped, or empty before
  /// the first step.
  std::vector<std::pair<std::string_view, std::span<const T>>> buffers;
};

/// State to load into an optimizer: the values of what its state() lists,
/// in the same order (hyper-parameters by value, buffers moved in). It
/// names no kind: Adam's and AdamW's have the same shape, so a caller that
/// moves state between optimizers by hand matches their state().kind
/// itself, as the checkpoint loaders do.
template <class T>
struct OptimizerState {
  std::uint64_t steps = 0;
  std::vector<double> hyperparameters;
  std::vector<std::vector<T>> buffers;
};

/// An optimizer a checkpoint can save and restore: `state()`;
/// `check_state(s)`, which throws InvalidArgument if `s` does not fit; and
/// `load_state(s)`, which checks the same and then replaces the step count,
/// hyper-parameters and buffers. A loader checks every piece of a
/// checkpoint before it changes any, so the check comes apart from the load.
template <class O, class T>
concept CheckpointableOptimizer = Optimizer<O, T> && requires(O& o, const O& co, OptimizerState<T> s) {
  { co.state() } -> std::same_as<OptimizerStateView<T>>;
  co.check_state(s);
  o.load_state(std::move(s));
};

namespace detail {

/// What every optimizer's load_state checks before it changes anything: as
/// many values as its state() lists, and buffers all of one size.
template <class T>
void check_state_shape(const char* who, const OptimizerState<T>& s, std::size_t hyperparameters,
                       std::size_t buffers) {
  if (s.hyperparameters.size() != hyperparameters || s.buffers.size() != buffers) {
    throw InvalidArgument(std::string("gradsync: ") + who + "::load_state expects " +
                          std::to_string(hyperparameters) + " hyper-parameters and " + std::to_string(buffers) +
                          " buffers, got " + std::to_string(s.hyperparameters.size()) + " and " +
                          std::to_string(s.buffers.size()));
  }
  for (const auto& b : s.buffers) {
    if (b.size() != s.buffers.front().size()) {
      throw InvalidArgument(std::string("gradsync: ") + who +
                            "::load_state expects buffers of one size (the span it steps), got " +
                            std::to_string(s.buffers.front().size()) + " and " + std::to_string(b.size()));
    }
  }
  // After a step the buffers hold the momentum or the moments; without them
  // the next step would start from zeros under the step count of a later
  // one (Adam's bias correction, Sgd's first-step rule).
  if (s.steps != 0 && buffers != 0 && s.buffers.front().empty()) {
    throw InvalidArgument(std::string("gradsync: ") + who + "::load_state: the state has taken " +
                          std::to_string(s.steps) + " steps but holds no buffers");
  }
}

/// Throws InvalidArgument unless `value` is finite and in [lo, hi), the
/// ranges torch.optim checks (with finiteness added): outside them an
/// optimizer trains on, silently, as something else (a negative learning
/// rate climbs the loss; beta1 = 1 divides by zero).
inline void check_hyperparameter(const char* who, const char* name, double value, double lo,
                                 double hi = std::numeric_limits<double>::infinity(), bool hi_open = true) {
  const bool ok = std::isfinite(value) && value >= lo && (hi_open ? value < hi : value <= hi);
  if (!ok) {
    auto text = [](double x) {
      char buf[32];
      return std::string(buf, std::to_chars(buf, buf + sizeof buf, x).ptr);
    };
    throw InvalidArgument(std::string("gradsync: ") + who + " expects " + name + " finite and in [" + text(lo) +
                          ", " + text(hi) + (hi_open ? ")" : "]") + ", got " + text(value));
  }
}

/// State elements the optimizer keeps per parameter (`state_per_element()`:
/// 0 for SGD, 1 with momentum, 2 for Adam and AdamW); 0 for an optimizer
/// that does not say, whose state no trainer can then count.
template <class O>
std::size_t optimizer_state_per_element(const O& opt) noexcept {
  if constexpr (requires {
                  { opt.state_per_element() } -> std::convertible_to<std::size_t>;
                }) {
    return opt.state_per_element();
  } else {
    return 0;
  }
}

/// An optimizer's state is sized by its first step; a later step on a span
/// of another size is a bug in the caller, not a new model.
/// `bound`: the state lives in storage lent for exactly `state` elements,
/// which may be none.
inline void check_step_sizes(const char* who, std::size_t params, std::size_t grads, std::size_t state,
                             bool bound = false) {
  if (params != grads) {
    throw InvalidArgument(std::string("gradsync: ") + who + "::step expects params and grads of the same size, got " +
                          std::to_string(params) + " and " + std::to_string(grads));
  }
  if (bound && state != params) {
    throw InvalidArgument(std::string("gradsync: ") + who + "::step on " + std::to_string(params) +
                          " elements, but its state is bound to " + std::to_string(state));
  }
  if (state != 0 && state != params) {
    throw InvalidArgument(std::string("gradsync: ") + who + "::step was first called on " + std::to_string(state) +
                          " elements and now on " + std::to_string(params) +
                          "; its state belongs to one flat span (call reset() to start over)");
  }
}

}  // namespace detail
}  // namespace gradsync
