#pragma once
// A model whose step costs O(Ψ), for the tests about what the trainers hold
// and move (memory, offload) rather than what they compute: Squares, its
// batch Scale, and random unit sizes.

#include <gradsync/gradsync.hpp>

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace test_squares {

/// One rank's batch: the factor its loss is scaled by.
struct Scale {
  float factor = 1;
};

/// Loss ½·factor·Σp² over units of the given sizes: forward reads every
/// unit in order, backward asks again in reverse, adds factor·p and reports
/// it ready. Costs O(Ψ), so large units train fast.
struct Squares {
  using value_type = float;

  std::vector<std::size_t> sizes;
  std::uint64_t seed = 1;
  /// init_unit's draws, one sequence across the units.
  std::mt19937 rng{};

  std::vector<gradsync::UnitSpec> units() const {
    std::vector<gradsync::UnitSpec> u;
    for (std::size_t i = 0; i < sizes.size(); ++i) u.push_back({"u" + std::to_string(i), {{"w", {sizes[i]}}}, {}});
    return u;
  }

  /// Unit by unit (the trainer calls it for 0, 1, ... in order), so a
  /// sharded trainer holds one wrapped unit in full at construction: the
  /// budget case in test_train_memory.cpp counts on it.
  void init_unit(std::size_t u, const gradsync::UnitView<float>& view) {
    // Uniform in [-1, 1) from the top 24 bits of each draw. Not
    // uniform_real_distribution: libstdc++'s computes long-double logs for
    // every value, and under the sanitizers the budget case in
    // test_train_memory.cpp spent most of its time there.
    if (u == 0) rng.seed(static_cast<std::uint32_t>(seed));
    for (float& x : view.flat_params) x = static_cast<float>(rng() >> 8) * 0x1p-23f - 1.0f;
  }

  double forward_backward(const Scale& batch, const gradsync::StepContext<float>& ctx) const {
    double loss = 0;
    for (std::size_t u = 0; u < sizes.size(); ++u) {
      const auto p = ctx.params(u);
      for (const float x : p->flat_params) loss += 0.5 * double(batch.factor) * double(x) * double(x);
    }
    for (std::size_t u = sizes.size(); u-- > 0;) {
      const auto p = ctx.params(u);
      for (std::size_t i = 0; i < p->flat_params.size(); ++i) p->flat_grads[i] += batch.factor * p->flat_params[i];
      ctx.ready(u);
    }
    return loss;
  }
};

/// Squares whose forward_backward throws, while `fail_after` ≥ 0, once it has
/// asked for that many units (forward's asks, then backward's), or after its
/// whole backward when it is 2·units.
struct Faulty {
  using value_type = float;
  Squares m;
  int fail_after = -1;

  std::vector<gradsync::UnitSpec> units() const { return m.units(); }
  void init_unit(std::size_t u, const gradsync::UnitView<float>& view) { m.init_unit(u, view); }
  double forward_backward(const Scale& batch, const gradsync::StepContext<float>& ctx) const {
    int asks = 0;
    auto ask = [&](std::size_t u) {
      if (asks++ == fail_after) throw std::runtime_error("the model failed");
      return ctx.params(u);
    };
    double loss = 0;
    for (std::size_t u = 0; u < m.sizes.size(); ++u) {
      const auto p = ask(u);  // held for the loop: the handle's release frees the unit
      for (const float x : p->flat_params) loss += 0.5 * double(batch.factor) * double(x) * double(x);
    }
    for (std::size_t u = m.sizes.size(); u-- > 0;) {
      const auto p = ask(u);
      for (std::size_t i = 0; i < p->flat_params.size(); ++i) p->flat_grads[i] += batch.factor * p->flat_params[i];
      ctx.ready(u);
    }
    if (asks == fail_after) throw std::runtime_error("the model failed");
    return loss;
  }
};

/// Squares computed in bfloat16 (compute_type): a sharded trainer lends it
/// each gathered unit in bfloat16 and takes its gradient in bfloat16; its
/// initial values, the master shard and the optimizer stay float. Its
/// arithmetic is float's on the bfloat16 values, rounded once into the
/// gradient, as a bfloat16 GEMM accumulates in float.
struct LowSquares {
  using value_type = float;
  using compute_type = gradsync::bfloat16;
  Squares model;

  std::vector<gradsync::UnitSpec> units() const { return model.units(); }
  void init_unit(std::size_t u, const gradsync::UnitView<float>& view) { model.init_unit(u, view); }
  double forward_backward(const Scale& batch, const gradsync::StepContext<gradsync::bfloat16>& ctx) const {
    double loss = 0;
    for (std::size_t u = 0; u < model.sizes.size(); ++u) {
      const auto p = ctx.params(u);
      for (const gradsync::bfloat16 x : p->flat_params) {
        const auto v = static_cast<double>(static_cast<float>(x));
        loss += 0.5 * double(batch.factor) * v * v;
      }
    }
    for (std::size_t u = model.sizes.size(); u-- > 0;) {
      const auto p = ctx.params(u);
      for (std::size_t i = 0; i < p->flat_params.size(); ++i) {
        gradsync::bfloat16& g = p->flat_grads[i];
        g = static_cast<float>(g) + batch.factor * static_cast<float>(p->flat_params[i]);
      }
      ctx.ready(u);
    }
    return loss;
  }
};

/// Four units of 1..largest elements, and one of fewer elements than N (some
/// ranks' chunks then hold only padding).
inline std::vector<std::size_t> random_sizes(std::mt19937_64& rng, int world, std::size_t largest = 40) {
  std::uniform_int_distribution<std::size_t> d(1, largest);
  std::vector<std::size_t> s{d(rng), d(rng), d(rng), d(rng)};
  s.push_back(world > 1 ? static_cast<std::size_t>(world) - 1 : 1);
  return s;
}

/// Squares with bind() only: the same values, written all at once, so a
/// sharded trainer holds every parameter at construction.
struct BindSquares {
  using value_type = float;
  Squares model;

  std::vector<gradsync::UnitSpec> units() const { return model.units(); }
  void bind(std::span<const gradsync::UnitView<float>> views) {
    for (std::size_t u = 0; u < views.size(); ++u) model.init_unit(u, views[u]);
  }
  double forward_backward(const Scale& batch, const gradsync::StepContext<float>& ctx) const {
    return model.forward_backward(batch, ctx);
  }
};

/// The initial values Squares{sizes, seed} writes, unit after unit: rank
/// 0's are what every trainer must start from.
inline std::vector<float> initial_values(const std::vector<std::size_t>& sizes, std::uint64_t seed) {
  Squares m{sizes, seed};
  std::vector<float> all;
  for (std::size_t u = 0; u < sizes.size(); ++u) {
    std::vector<float> unit(sizes[u]);
    gradsync::UnitView<float> v;
    v.flat_params = std::span<float>(unit);
    m.init_unit(u, v);
    all.insert(all.end(), unit.begin(), unit.end());
  }
  return all;
}

/// "a, b, c": for the failure messages.
inline std::string joined(const std::vector<std::size_t>& sizes) {
  std::string s;
  for (const std::size_t p : sizes) s += (s.empty() ? "" : ", ") + std::to_string(p);
  return s;
}

}  // namespace test_squares
