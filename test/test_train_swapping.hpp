#pragma once
// A model whose ranks may visit units of equal size in different orders:
// what data-dependent control flow, or a bug, does. Only the units'
// identity tells the calls apart, so only labelled collectives notice.

#include <gradsync/gradsync.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "test_train_squares.hpp"

namespace test_swapping {

using test_squares::Scale;

/// Units fc0..fc{k-1} of equal size, loss ½·Σw². Forward and backward visit
/// them in order, except that rank `odd` swaps units `a` and `b` in step
/// `bad_step` (counted from 1): what a model with data-dependent control
/// flow, or a bug, does. Equal sizes, so only the units' identity differs.
struct Swapping {
  using value_type = float;

  std::size_t units_n = 4;
  std::size_t size = 12;
  int rank = 0, odd = -1;
  std::size_t a = 1, b = 2, bad_step = 0;
  mutable std::size_t steps = 0;

  std::vector<gradsync::UnitSpec> units() const {
    std::vector<gradsync::UnitSpec> u;
    for (std::size_t i = 0; i < units_n; ++i) u.push_back({"fc" + std::to_string(i), {{"weight", {size}}}, {}});
    return u;
  }
  void init_unit(std::size_t u, const gradsync::UnitView<float>& view) {
    for (std::size_t i = 0; i < view.flat_params.size(); ++i) view.flat_params[i] = 0.01f * float(u + 1) + 0.001f * float(i);
  }
  std::vector<std::size_t> order() const {
    std::vector<std::size_t> o(units_n);
    for (std::size_t i = 0; i < units_n; ++i) o[i] = i;
    if (rank == odd && steps == bad_step) std::swap(o[a], o[b]);
    return o;
  }
  double forward_backward(const Scale& batch, const gradsync::StepContext<float>& ctx) const {
    ++steps;
    const std::vector<std::size_t> o = order();
    double loss = 0;
    for (const std::size_t u : o) {
      const auto p = ctx.params(u);
      for (const float x : p->flat_params) loss += 0.5 * double(batch.factor) * double(x) * double(x);
    }
    for (std::size_t i = o.size(); i-- > 0;) {
      const auto p = ctx.params(o[i]);
      for (std::size_t k = 0; k < p->flat_params.size(); ++k) p->flat_grads[k] += batch.factor * p->flat_params[k];
      ctx.ready(o[i]);
    }
    return loss;
  }
};

}  // namespace test_swapping
