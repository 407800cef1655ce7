#pragma once
// A small MLP for the trainer tests: plain loops, so the tests need nothing
// but doctest. tanh hidden layers, linear output, mean squared error.

#include <gradsync/gradsync.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace test_train {

/// Inputs and targets of `size` samples, row-major.
template <class T>
struct Batch {
  std::size_t size = 0;
  std::vector<T> x, y;
  /// Skip the auxiliary unit on this batch (for unused-parameter tests).
  bool skip_aux = false;
};

/// Samples [first, first + count) of a fixed synthetic regression set.
template <class T>
Batch<T> make_batch(std::size_t first, std::size_t count, std::size_t in, std::size_t out) {
  Batch<T> b;
  b.size = count;
  for (std::size_t i = first; i < first + count; ++i) {
    for (std::size_t j = 0; j < in; ++j) b.x.push_back(static_cast<T>(std::sin(0.37 * double(i) + 1.3 * double(j))));
    for (std::size_t k = 0; k < out; ++k) b.y.push_back(static_cast<T>(std::cos(0.11 * double(i) * double(k + 1))));
  }
  return b;
}

/// Layers sizes[0] -> sizes[1] -> ... -> sizes.back(); one unit per layer,
/// plus an optional auxiliary unit (a bias added to the output) that a
/// batch may skip. Unit 0 carries a buffer counting samples seen.
template <class T>
struct Mlp {
  using value_type = T;

  std::vector<std::size_t> sizes;
  std::uint64_t init_seed = 1;
  bool with_aux = false;

  std::vector<gradsync::UnitSpec> units() const {
    std::vector<gradsync::UnitSpec> u;
    for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
      gradsync::UnitSpec s{"layer" + std::to_string(l), {{"w", {sizes[l + 1], sizes[l]}}, {"b", {sizes[l + 1]}}}, {}};
      if (l == 0) s.buffers.push_back({"seen", {}});
      u.push_back(std::move(s));
    }
    if (with_aux) u.push_back({"aux", {{"bias", {sizes.back()}}}, {}});
    return u;
  }

  /// Writes the initial values; keeps no views (the protocol's rule).
  void bind(std::span<const gradsync::UnitView<T>> views) {
    // Rank-dependent values on purpose: the trainer must replace them.
    std::uint64_t s = init_seed * 0x9E3779B97F4A7C15ull + 12345;
    for (const auto& unit : views) {
      for (const auto& p : unit.params) {
        const double fan_in = p.spec->shape.size() == 2 ? double(p.spec->shape[1]) : 4.0;
        for (T& x : p.value) {
          s = s * 6364136223846793005ull + 1442695040888963407ull;
          x = static_cast<T>((double(s >> 11) / double(1ull << 53) - 0.5) * 2.0 / std::sqrt(fan_in));
        }
      }
      for (const auto& b : unit.buffers) std::fill(b.value.begin(), b.value.end(), static_cast<T>(init_seed));
    }
  }

  /// Asks for each layer in forward and again in backward, and reports it
  /// ready while still holding it.
  double forward_backward(const Batch<T>& batch, const gradsync::StepContext<T>& ctx) {
    const std::size_t n = batch.size, L = sizes.size() - 1;
    std::vector<std::vector<T>> act(L + 1);
    act[0] = batch.x;
    for (std::size_t l = 0; l < L; ++l) {
      const auto p = ctx.params(l);
      const std::size_t in = sizes[l], out = sizes[l + 1];
      auto w = p->params[0].value;
      auto b = p->params[1].value;
      act[l + 1].assign(n * out, T(0));
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t o = 0; o < out; ++o) {
          T z = b[o];
          for (std::size_t k = 0; k < in; ++k) z += w[o * in + k] * act[l][i * in + k];
          act[l + 1][i * out + o] = l + 1 < L ? std::tanh(z) : z;
        }
      if (l == 0) p->buffers[0].value[0] += static_cast<T>(n);
    }
    const std::size_t out = sizes.back();
    const bool aux = with_aux && !batch.skip_aux;
    if (aux) {
      const auto p = ctx.params(L);
      auto bias = p->params[0].value;
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t o = 0; o < out; ++o) act[L][i * out + o] += bias[o];
    }
    double loss = 0;
    std::vector<T> delta(n * out);
    for (std::size_t i = 0; i < n * out; ++i) {
      const T e = act[L][i] - batch.y[i];
      loss += 0.5 * double(e) * double(e);
      delta[i] = e / static_cast<T>(n);
    }
    if (aux) {
      const auto p = ctx.params(L);
      auto g = p->params[0].grad;
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t o = 0; o < out; ++o) g[o] += delta[i * out + o];
      ctx.ready(L);
    }
    for (std::size_t l = L; l-- > 0;) {
      const auto p = ctx.params(l);
      const std::size_t in = sizes[l], o_n = sizes[l + 1];
      auto w = p->params[0].value;
      auto gw = p->params[0].grad;
      auto gb = p->params[1].grad;
      std::vector<T> prev(n * in, T(0));
      for (std::size_t i = 0; i < n; ++i)
        for (std::size_t o = 0; o < o_n; ++o) {
          const T d = delta[i * o_n + o];
          gb[o] += d;
          for (std::size_t k = 0; k < in; ++k) {
            gw[o * in + k] += d * act[l][i * in + k];
            prev[i * in + k] += d * w[o * in + k];
          }
        }
      ctx.ready(l);
      if (l > 0)
        for (std::size_t j = 0; j < n * in; ++j) prev[j] *= T(1) - act[l][j] * act[l][j];
      delta = std::move(prev);
    }
    return loss / double(n);
  }
};

}  // namespace test_train

namespace test_train {

/// A model that declares whatever units it is given, for the tests of what
/// ranks must agree on. Its loss is half the sum of squared parameters.
template <class T>
struct Declared {
  using value_type = T;

  std::vector<gradsync::UnitSpec> specs;

  std::vector<gradsync::UnitSpec> units() const { return specs; }

  void bind(std::span<const gradsync::UnitView<T>> views) {
    for (const auto& unit : views)
      for (std::size_t i = 0; i < unit.flat_params.size(); ++i) unit.flat_params[i] = static_cast<T>(i % 7) - T(3);
  }

  double forward_backward(const Batch<T>&, const gradsync::StepContext<T>& ctx) {
    double loss = 0;
    for (std::size_t u = specs.size(); u-- > 0;) {
      const auto p = ctx.params(u);
      for (std::size_t i = 0; i < p->flat_params.size(); ++i) {
        loss += 0.5 * double(p->flat_params[i]) * double(p->flat_params[i]);
        p->flat_grads[i] += p->flat_params[i];
      }
      ctx.ready(u);
    }
    return loss;
  }
};

/// The names the trainer tests use unqualified, declared once: a test file
/// says `using namespace test_train::names;`.
namespace names {
using gradsync::Communicator;
using gradsync::DistributedSampler;
using gradsync::ReplicatedTrainer;
using gradsync::ReplicatedTrainerOptions;
using gradsync::ShardedTrainer;
using gradsync::ShardedTrainerOptions;
using gradsync::ShardingStrategy;
using gradsync::Threads;
using test_train::Batch;
using test_train::Declared;
using test_train::make_batch;
using test_train::Mlp;
}  // namespace names

}  // namespace test_train
