#pragma once
/// \file What a trainer asks of an optimizer: a step on flat spans.

#include <concepts>
#include <cstddef>
#include <span>
#include <string>

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

namespace detail {

/// An optimizer's state is sized by its first step; a later step on a span
/// of another size is a bug in the caller, not a new model.
inline void check_step_sizes(const char* who, std::size_t params, std::size_t grads, std::size_t state) {
  if (params != grads) {
    throw InvalidArgument(std::string("gradsync: ") + who + "::step expects params and grads of the same size, got " +
                          std::to_string(params) + " and " + std::to_string(grads));
  }
  if (state != 0 && state != params) {
    throw InvalidArgument(std::string("gradsync: ") + who + "::step was first called on " + std::to_string(state) +
                          " elements and now on " + std::to_string(params) +
                          "; its state belongs to one flat span (call reset() to start over)");
  }
}

}  // namespace detail
}  // namespace gradsync
