// Optimizers on flat spans (SGD, momentum, Adam, AdamW) and the LR scaling rule.
#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/common.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_optimizers {

using doctest::Approx;

TEST_CASE("SGD: p -= lr * (g + weight_decay * p)") {
  gradsync::Sgd<double> sgd({.lr = 0.5, .weight_decay = 0.1});
  std::vector<double> p{1.0, -2.0}, g{0.2, 0.4};
  sgd.step(std::span<double>(p), std::span<const double>(g));
  CHECK(p[0] == Approx(1.0 - 0.5 * (0.2 + 0.1)));
  CHECK(p[1] == Approx(-2.0 - 0.5 * (0.4 - 0.2)));
}

TEST_CASE("SGD with momentum follows torch.optim.SGD: v = g first, then v = mu v + (1 - dampening) g") {
  gradsync::Sgd<double> sgd({.lr = 0.1, .momentum = 0.9, .dampening = 0.5});
  std::vector<double> p{1.0}, g{2.0};
  sgd.step(std::span<double>(p), std::span<const double>(g));  // v = 2
  CHECK(p[0] == Approx(1.0 - 0.1 * 2.0));
  g[0] = 1.0;
  sgd.step(std::span<double>(p), std::span<const double>(g));  // v = 0.9 * 2 + 0.5 * 1 = 2.3
  CHECK(p[0] == Approx(0.8 - 0.1 * 2.3));
  gradsync::Sgd<double> nesterov({.lr = 0.1, .momentum = 0.9, .nesterov = true});
  std::vector<double> q{0.0}, h{1.0};
  nesterov.step(std::span<double>(q), std::span<const double>(h));  // v = 1, step g + mu v = 1.9
  CHECK(q[0] == Approx(-0.19));
}

TEST_CASE("Adam and AdamW follow torch.optim's update, bias corrections included") {
  const double lr = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  auto reference = [&](bool decoupled) {
    double p = 1.5, m = 0, v = 0;
    for (int t = 1; t <= 3; ++t) {
      double g = 0.3 * t - 0.5;
      if (decoupled) {
        p *= 1 - lr * wd;
      } else {
        g += wd * p;
      }
      m = b1 * m + (1 - b1) * g;
      v = b2 * v + (1 - b2) * g * g;
      p -= lr * (m / (1 - std::pow(b1, t))) / (std::sqrt(v / (1 - std::pow(b2, t))) + eps);
    }
    return p;
  };
  gradsync::Adam<double> adam({.lr = lr, .weight_decay = wd});
  gradsync::AdamW<double> adamw({.lr = lr, .weight_decay = wd});
  std::vector<double> p{1.5}, q{1.5};
  for (int t = 1; t <= 3; ++t) {
    const std::vector<double> g{0.3 * t - 0.5};
    adam.step(std::span<double>(p), std::span<const double>(g));
    adamw.step(std::span<double>(q), std::span<const double>(g));
  }
  CHECK(p[0] == Approx(reference(false)).epsilon(1e-12));
  CHECK(q[0] == Approx(reference(true)).epsilon(1e-12));
  CHECK(p[0] != Approx(q[0]).epsilon(1e-9));
}

TEST_CASE_TEMPLATE("an optimizer stepped on two shards equals one stepped on the whole span", Opt,
                   gradsync::Sgd<float>, gradsync::Adam<float>, gradsync::AdamW<float>) {
  auto make = [] {
    if constexpr (std::is_same_v<Opt, gradsync::Sgd<float>>) {
      return Opt({.lr = 0.05, .momentum = 0.9});
    } else {
      return Opt({.lr = 0.05, .weight_decay = 0.01});
    }
  };
  Opt whole = make(), left = make(), right = make();
  std::vector<float> p(10), q(10), g(10);
  for (int i = 0; i < 10; ++i) p[static_cast<std::size_t>(i)] = q[static_cast<std::size_t>(i)] = 0.1f * float(i) - 0.4f;
  for (int step = 0; step < 4; ++step) {
    for (int i = 0; i < 10; ++i) g[static_cast<std::size_t>(i)] = std::sin(float(i + step));
    whole.step(std::span<float>(p), std::span<const float>(g));
    left.step(std::span<float>(q).first(4), std::span<const float>(g).first(4));
    right.step(std::span<float>(q).subspan(4), std::span<const float>(g).subspan(4));
  }
  CHECK(p == q);
  // Its state belongs to one span size; another size is a caller bug.
  CHECK_THROWS_AS(whole.step(std::span<float>(p).first(3), std::span<const float>(g).first(3)),
                  gradsync::InvalidArgument);
  static_assert(gradsync::Optimizer<Opt, float>);
}

// bind_state (what an offloaded ShardedTrainer does): the state moves into
// the lent storage and steps there bitwise as in the optimizer's vectors;
// a copy owns its values; checkpoints' load copies in; bad sizes throw.
TEST_CASE_TEMPLATE("an optimizer bound to lent storage steps bitwise as one on its own vectors", Opt,
                   gradsync::Sgd<float>, gradsync::Adam<float>, gradsync::AdamW<float>) {
  auto rng = test::rng_for("bound optimizer state");
  const std::size_t n = std::uniform_int_distribution<std::size_t>(1, 100)(rng);
  INFO("seed = " << test::test_seed() << ", n = " << n);
  std::normal_distribution<float> normal;
  auto make = [] {
    if constexpr (std::is_same_v<Opt, gradsync::Sgd<float>>) {
      return Opt({.lr = 0.05, .momentum = 0.9});
    } else {
      return Opt({.lr = 0.05, .weight_decay = 0.01});
    }
  };
  std::vector<float> p(n), g(n);
  for (float& x : p) x = normal(rng);
  std::vector<float> q = p, r = p;
  Opt own = make(), bound = make(), late = make();
  const std::size_t slots = own.state_per_element();
  REQUIRE(slots > 0);
  std::vector<float> storage(slots * n, 42.0f), later(slots * n, 42.0f);
  bound.bind_state(std::span<float>(storage), n);
  // Lent storage starts zeroed: no state yet.
  CHECK(std::ranges::all_of(storage, [](float x) { return x == 0.0f; }));
  auto in = [](std::span<const float> s, const std::vector<float>& v) {
    const std::less_equal<> le;
    return !s.empty() && le(v.data(), s.data()) && le(s.data() + s.size(), v.data() + v.size());
  };
  for (int step = 0; step < 5; ++step) {
    for (float& x : g) x = normal(rng);
    own.step(std::span<float>(p), std::span<const float>(g));
    bound.step(std::span<float>(q), std::span<const float>(g));
    late.step(std::span<float>(r), std::span<const float>(g));
    // Bound after two steps: what it held moves into the storage.
    if (step == 1) late.bind_state(std::span<float>(later), n);
  }
  CHECK(p == q);
  CHECK(p == r);
  CHECK(own.state_elements() == slots * n);
  CHECK(bound.state_elements() == 0);
  CHECK(late.state_elements() == 0);
  const auto a = own.state(), b = bound.state(), c = late.state();
  REQUIRE(b.buffers.size() == slots);
  for (std::size_t k = 0; k < slots; ++k) {
    CAPTURE(k);
    CHECK(std::ranges::equal(a.buffers[k].second, b.buffers[k].second));
    CHECK(std::ranges::equal(a.buffers[k].second, c.buffers[k].second));
    CHECK(in(b.buffers[k].second, storage));
    CHECK(in(c.buffers[k].second, later));
  }

  // A copy holds its own values: stepping it leaves the storage alone.
  Opt copy = bound;
  CHECK(copy.state_elements() == slots * n);
  const std::vector<float> before = storage;
  std::vector<float> s = q;
  copy.step(std::span<float>(s), std::span<const float>(g));
  CHECK(storage == before);

  // A load copies into the storage; one of another size is refused first.
  gradsync::OptimizerState<float> saved{a.steps, {}, {}};
  for (const auto& h : a.hyperparameters) saved.hyperparameters.push_back(h.second);
  for (const auto& buf : a.buffers) saved.buffers.emplace_back(buf.second.begin(), buf.second.end());
  gradsync::OptimizerState<float> wrong = saved;
  for (auto& buf : wrong.buffers) buf.push_back(1.0f);
  CHECK_THROWS_AS(bound.check_state(wrong), gradsync::InvalidArgument);
  CHECK_THROWS_AS(bound.load_state(wrong), gradsync::InvalidArgument);
  CHECK(storage == before);
  std::ranges::fill(storage, 0.0f);
  bound.load_state(saved);
  CHECK(storage == before);
  CHECK(bound.state_elements() == 0);

  // Storage of the wrong size, or a span other than the bound one, is refused.
  Opt other = make();
  std::vector<float> small(slots * n - 1);
  CHECK_THROWS_AS(other.bind_state(std::span<float>(small), n), gradsync::InvalidArgument);
  CHECK_THROWS_AS(bound.step(std::span<float>(q).first(n - 1), std::span<const float>(g).first(n - 1)),
                  gradsync::InvalidArgument);
  // reset() zeroes the lent storage and keeps it.
  bound.reset();
  CHECK(std::ranges::all_of(storage, [](float x) { return x == 0.0f; }));
  CHECK(bound.state().steps == 0);
}

// The scalar loops the optimizers ran before their steps became blocks
// that vectorize, kept as the reference: the same formulas as torch.optim,
// one element at a time, Adam's bias corrections unfolded.
template <class T>
void reference_adam_step(const gradsync::AdamOptions& o, bool decoupled, std::size_t t, std::vector<T>& p,
                         const std::vector<T>& g, std::vector<T>& m, std::vector<T>& v) {
  const T b1 = static_cast<T>(o.beta1), b2 = static_cast<T>(o.beta2), lr = static_cast<T>(o.lr);
  const T wd = static_cast<T>(o.weight_decay), eps = static_cast<T>(o.eps);
  const T c1 = static_cast<T>(1 - std::pow(o.beta1, static_cast<double>(t)));
  const T sqrt_c2 = static_cast<T>(std::sqrt(1 - std::pow(o.beta2, static_cast<double>(t))));
  const T decay = static_cast<T>(1 - o.lr * o.weight_decay);
  for (std::size_t i = 0; i < p.size(); ++i) {
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

template <class T>
void reference_sgd_step(const gradsync::SgdOptions& o, bool first, std::vector<T>& p, const std::vector<T>& g,
                        std::vector<T>& v) {
  const T lr = static_cast<T>(o.lr), wd = static_cast<T>(o.weight_decay);
  const T mu = static_cast<T>(o.momentum), keep = static_cast<T>(1 - o.dampening);
  for (std::size_t i = 0; i < p.size(); ++i) {
    const T gi = g[i] + wd * p[i];
    if (o.momentum == 0) {
      p[i] -= lr * gi;
      continue;
    }
    v[i] = first ? gi : mu * v[i] + keep * gi;
    p[i] -= lr * (o.nesterov ? gi + mu * v[i] : v[i]);
  }
}

/// max |a - b| over the values' scale: max |b|, or `floor` where that is less
/// (an element's own relative difference is unbounded where a step cancels
/// it to near 0, and a span of one element is one such element).
template <class T>
double relative_difference(std::span<const T> a, std::span<const T> b, double floor) {
  double diff = 0, scale = floor;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

// Sizes around the vector block (16 floats, 8 doubles) and odd ones: the
// blocks and the tail agree with the scalar loop. Adam's folded bias
// corrections round differently from the unfolded ones (and a compiler may
// fuse multiply-adds in one loop and not the other), so p - update may round
// one ulp of p apart at each step: at most ~6 ulp (7e-7 of the largest
// parameter in float) after 6 steps; seen up to 5.9e-7 over 40 seeds at
// -march=native. The bound, 1.5e-6, is about twice that (1e-14 in double). The
// scales: parameters ~1, gradients and m ~0.1, v ~0.01.
TEST_CASE_TEMPLATE("the vectorized optimizer steps equal the scalar reference loops", T, float, double) {
  auto rng = test::rng_for("optimizer steps against the scalar reference");
  INFO("seed = " << test::test_seed());
  const double tol = std::is_same_v<T, float> ? 1.5e-6 : 1e-14;
  std::normal_distribution<T> normal;
  for (const std::size_t n : {std::size_t{1}, std::size_t{3}, std::size_t{7}, std::size_t{8}, std::size_t{15},
                              std::size_t{16}, std::size_t{17}, std::size_t{31}, std::size_t{33}, std::size_t{100},
                              std::size_t{257}, std::size_t{1000}, std::size_t{4099}}) {
    CAPTURE(n);
    std::vector<T> p0(n);
    for (T& x : p0) x = normal(rng);
    std::vector<std::vector<T>> grads(6, std::vector<T>(n));
    for (auto& g : grads) {
      for (T& x : g) x = T(0.1) * normal(rng);
    }
    for (const gradsync::AdamOptions& o :
         {gradsync::AdamOptions{.lr = 1e-2}, gradsync::AdamOptions{.lr = 1e-2, .weight_decay = 0.1},
          gradsync::AdamOptions{.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.01}}) {
      for (const bool decoupled : {false, true}) {
        CAPTURE(decoupled);
        CAPTURE(o.weight_decay);
        std::vector<T> p = p0, q = p0, m(n), v(n);
        gradsync::Adam<T> adam(o);
        gradsync::AdamW<T> adamw(o);
        for (std::size_t t = 1; t <= grads.size(); ++t) {
          const std::span<const T> g(grads[t - 1]);
          decoupled ? adamw.step(std::span<T>(p), g) : adam.step(std::span<T>(p), g);
          reference_adam_step(o, decoupled, t, q, grads[t - 1], m, v);
        }
        const auto s = decoupled ? adamw.state() : adam.state();
        CHECK(relative_difference<T>(p, q, 1.0) <= tol);
        CHECK(relative_difference<T>(s.buffers[0].second, m, 0.1) <= tol);
        CHECK(relative_difference<T>(s.buffers[1].second, v, 0.01) <= tol);
      }
    }
    for (const gradsync::SgdOptions& o :
         {gradsync::SgdOptions{.lr = 0.1, .weight_decay = 0.01}, gradsync::SgdOptions{.lr = 0.1, .momentum = 0.9},
          gradsync::SgdOptions{.lr = 0.1, .momentum = 0.9, .dampening = 0.3, .weight_decay = 0.01},
          gradsync::SgdOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true}}) {
      CAPTURE(o.momentum);
      CAPTURE(o.nesterov);
      std::vector<T> p = p0, q = p0, v(n);
      gradsync::Sgd<T> sgd(o);
      for (std::size_t t = 0; t < grads.size(); ++t) {
        sgd.step(std::span<T>(p), std::span<const T>(grads[t]));
        reference_sgd_step(o, t == 0, q, grads[t], v);
      }
      CHECK(relative_difference<T>(p, q, 1.0) <= tol);
    }
  }
}

namespace {

/// `n` parameters drawn from `normal(rng)`, stepped `steps` times on the same
/// gradients (drawn from it, a step's after the last) two ways: `step_a(p, g)`
/// on them and `step_b(q, g)` on a copy. Returns both ways' parameters.
template <class T, class Normal, class Rng, class StepA, class StepB>
std::pair<std::vector<T>, std::vector<T>> stepped_two_ways(std::size_t n, int steps, Normal& normal, Rng& rng,
                                                           StepA step_a, StepB step_b) {
  std::vector<T> p(n), g(n);
  for (T& x : p) x = normal(rng);
  std::vector<T> q = p;
  for (int step = 0; step < steps; ++step) {
    for (T& x : g) x = normal(rng);
    step_a(std::span<T>(p), std::span<const T>(g));
    step_b(std::span<T>(q), std::span<const T>(g));
  }
  return {std::move(p), std::move(q)};
}

}  // namespace

// Each element's update depends on that element only, whether it falls in a
// vector block or the tail: shards at any offset step bitwise as the whole.
TEST_CASE_TEMPLATE("optimizer shards at odd offsets step bitwise as the whole span", Opt, gradsync::Sgd<float>,
                   gradsync::Adam<float>, gradsync::AdamW<float>) {
  auto rng = test::rng_for("optimizer shards at odd offsets");
  INFO("seed = " << test::test_seed());
  std::normal_distribution<float> normal;
  const std::size_t n = 1000;
  for (const std::size_t cut : {std::size_t{1}, std::size_t{13}, std::size_t{16}, std::size_t{333}, std::size_t{999}}) {
    CAPTURE(cut);
    auto make = [] {
      if constexpr (std::is_same_v<Opt, gradsync::Sgd<float>>) {
        return Opt({.lr = 0.05, .momentum = 0.9, .nesterov = true});
      } else {
        return Opt({.lr = 0.05, .weight_decay = 0.01});
      }
    };
    Opt whole = make(), left = make(), right = make();
    const auto [p, q] = stepped_two_ways<float>(
        n, 4, normal, rng, [&](std::span<float> x, std::span<const float> g) { whole.step(x, g); },
        [&](std::span<float> x, std::span<const float> g) {
          left.step(x.first(cut), g.first(cut));
          right.step(x.subspan(cut), g.subspan(cut));
        });
    CHECK(p == q);
  }
}

// options.threads splits a step into parts on several threads: the result
// must be bitwise that of one thread, for every option set, at sizes that
// split into 2 to 4 parts with a tail, and saved state must keep the setting.
TEST_CASE_TEMPLATE("an optimizer step shared by threads is bitwise the one-thread step", T, float, double) {
  auto rng = test::rng_for("optimizer threads");
  INFO("seed = " << test::test_seed());
  std::normal_distribution<T> normal;
  const std::size_t n = 2 * gradsync::detail::min_step_part + rng() % (3 * gradsync::detail::min_step_part);
  const unsigned threads = 2 + static_cast<unsigned>(rng() % 3);
  CAPTURE(n);
  CAPTURE(threads);
  auto check = [&](auto one, auto many, const char* what) {
    INFO(what);
    const auto [p, q] = stepped_two_ways<T>(
        n, 3, normal, rng, [&](std::span<T> x, std::span<const T> g) { one.step(x, g); },
        [&](std::span<T> x, std::span<const T> g) { many.step(x, g); });
    CHECK(p == q);
    const auto a = one.state(), b = many.state();
    REQUIRE(a.buffers.size() == b.buffers.size());
    for (std::size_t k = 0; k < a.buffers.size(); ++k) {
      CHECK(std::equal(a.buffers[k].second.begin(), a.buffers[k].second.end(), b.buffers[k].second.begin(),
                       b.buffers[k].second.end()));
    }
    // Loading a state keeps the thread count: it is not a hyper-parameter.
    gradsync::OptimizerState<T> loaded{b.steps, {}, {}};
    for (const auto& [name, value] : b.hyperparameters) loaded.hyperparameters.push_back(value);
    for (const auto& [name, values] : b.buffers) loaded.buffers.emplace_back(values.begin(), values.end());
    many.load_state(std::move(loaded));
    CHECK(many.options().threads == threads);
  };
  for (const bool nesterov : {false, true}) {
    for (const double momentum : {0.0, 0.9}) {
      if (nesterov && momentum == 0) continue;
      const gradsync::SgdOptions o{.lr = 0.05, .momentum = momentum, .weight_decay = 0.01, .nesterov = nesterov};
      gradsync::SgdOptions m = o;
      m.threads = threads;
      check(gradsync::Sgd<T>(o), gradsync::Sgd<T>(m), nesterov ? "Sgd nesterov" : momentum ? "Sgd momentum" : "Sgd");
    }
  }
  gradsync::AdamOptions a{.lr = 0.01, .weight_decay = 0.01};
  gradsync::AdamOptions am = a;
  am.threads = threads;
  check(gradsync::Adam<T>(a), gradsync::Adam<T>(am), "Adam");
  check(gradsync::AdamW<T>(a), gradsync::AdamW<T>(am), "AdamW");
}

TEST_CASE("linear LR scaling: 0.1 at batch 64 becomes 0.4 at effective batch 256") {
  CHECK(gradsync::linear_scaled_lr(0.1, 64, 256) == Approx(0.4));
  CHECK(gradsync::linear_scaled_lr(0.1, 64, 64) == Approx(0.1));
  CHECK(gradsync::linear_scaled_lr(0, 64, 256) == 0);
  CHECK_THROWS_AS(gradsync::linear_scaled_lr(0.1, 0, 256), gradsync::InvalidArgument);
  for (const double bad : {-0.1, std::nan(""), double{INFINITY}}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(gradsync::linear_scaled_lr(bad, 64, 256), doctest::Contains("base learning rate"),
                         gradsync::InvalidArgument);
  }
}

TEST_CASE("optimizers refuse what torch.optim refuses, at construction, in set_lr and in a loaded state") {
  const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
  using gradsync::AdamOptions;
  using gradsync::SgdOptions;
  struct SgdCase {
    SgdOptions o;
    const char* says;
  };
  for (const SgdCase& c : {SgdCase{{.lr = -0.1}, "lr"}, SgdCase{{.lr = nan}, "lr"}, SgdCase{{.lr = inf}, "lr"},
                           SgdCase{{.momentum = -0.5}, "momentum"}, SgdCase{{.momentum = nan}, "momentum"},
                           SgdCase{{.dampening = nan}, "dampening"}, SgdCase{{.weight_decay = -1}, "weight_decay"},
                           SgdCase{{.nesterov = true}, "nesterov"},
                           SgdCase{{.momentum = 0.9, .dampening = 0.5, .nesterov = true}, "nesterov"}}) {
    CAPTURE(c.says);
    CHECK_THROWS_WITH_AS(gradsync::Sgd<float>{c.o}, doctest::Contains(c.says), gradsync::InvalidArgument);
  }
  struct AdamCase {
    AdamOptions o;
    const char* says;
  };
  for (const AdamCase& c :
       {AdamCase{{.lr = -1e-3}, "lr"}, AdamCase{{.lr = nan}, "lr"}, AdamCase{{.beta1 = 1}, "beta1"},
        AdamCase{{.beta1 = -0.1}, "beta1"}, AdamCase{{.beta1 = 1.5}, "beta1"}, AdamCase{{.beta2 = 1}, "beta2"},
        AdamCase{{.beta2 = -0.1}, "beta2"}, AdamCase{{.eps = -1e-8}, "eps"}, AdamCase{{.eps = nan}, "eps"},
        AdamCase{{.weight_decay = -0.01}, "weight_decay"}, AdamCase{{.weight_decay = inf}, "weight_decay"}}) {
    CAPTURE(c.says);
    CHECK_THROWS_WITH_AS(gradsync::Adam<float>{c.o}, doctest::Contains(c.says), gradsync::InvalidArgument);
    CHECK_THROWS_WITH_AS(gradsync::AdamW<double>{c.o}, doctest::Contains(c.says), gradsync::InvalidArgument);
  }
  // What torch.optim accepts is accepted: lr 0, beta 0, eps 0, any finite dampening.
  CHECK_NOTHROW(gradsync::Sgd<float>({.lr = 0, .momentum = 0.9, .dampening = 1.5}));
  CHECK_NOTHROW(gradsync::Adam<float>({.lr = 0, .beta1 = 0, .beta2 = 0, .eps = 0}));

  gradsync::Sgd<float> sgd({.lr = 0.25, .momentum = 0.9});
  gradsync::AdamW<float> adamw({.lr = 0.25});
  for (const double bad : {-0.1, nan, inf}) {
    CHECK_THROWS_WITH_AS(sgd.set_lr(bad), doctest::Contains("lr"), gradsync::InvalidArgument);
    CHECK_THROWS_WITH_AS(adamw.set_lr(bad), doctest::Contains("lr"), gradsync::InvalidArgument);
  }
  CHECK(sgd.lr() == 0.25);
  CHECK(adamw.lr() == 0.25);
  // A loaded state's hyper-parameters are checked as the constructor's,
  // before anything changes.
  CHECK_THROWS_WITH_AS(sgd.load_state({1, {nan, 0.9, 0, 0, 0}, {std::vector<float>(3)}}), doctest::Contains("lr"),
                       gradsync::InvalidArgument);
  CHECK_THROWS_WITH_AS(adamw.load_state({1, {0.1, -1, 0.99, 1e-8, 0}, {std::vector<float>(3), std::vector<float>(3)}}),
                       doctest::Contains("beta1"), gradsync::InvalidArgument);
  CHECK_THROWS_WITH_AS(adamw.load_state({1, {0.1, 0.9, 2, 1e-8, 0}, {std::vector<float>(3), std::vector<float>(3)}}),
                       doctest::Contains("beta2"), gradsync::InvalidArgument);
  CHECK_THROWS_WITH_AS(adamw.load_state({1, {0.1, 0.9, 0.99, -1, 0}, {std::vector<float>(3), std::vector<float>(3)}}),
                       doctest::Contains("eps"), gradsync::InvalidArgument);
  CHECK(sgd.lr() == 0.25);
  CHECK(adamw.lr() == 0.25);
}

TEST_CASE_TEMPLATE("a step on no elements is not counted; a state that took steps without buffers is refused", Opt,
                   gradsync::Sgd<double>, gradsync::Adam<double>, gradsync::AdamW<double>) {
  auto make = [] {
    if constexpr (std::is_same_v<Opt, gradsync::Sgd<double>>) {
      return Opt({.lr = 0.1, .momentum = 0.9, .dampening = 0.5});
    } else {
      return Opt({.lr = 0.1});
    }
  };
  std::vector<double> g{1.0, -2.0, 0.5, 3.0, -1.0};
  auto run = [&](Opt& o) {
    std::vector<double> p{1.0, 2.0, 3.0, 4.0, 5.0};
    for (int s = 0; s < 3; ++s) o.step(std::span<double>(p), std::span<const double>(g));
    return p;
  };
  Opt fresh = make();
  const std::vector<double> want = run(fresh);
  // An empty step first, as a rank with no parameters would take: the
  // steps after it are those of a fresh optimizer (Adam's bias correction,
  // Sgd's first-step momentum), bitwise.
  Opt after_empty = make();
  after_empty.step(std::span<double>(), std::span<const double>());
  CHECK(after_empty.state().steps == 0);
  CHECK(run(after_empty) == want);
  // Bound to storage for no elements: a step on five is refused, not a write past it.
  Opt bound = make();
  std::vector<double> none;
  bound.bind_state(std::span<double>(none), 0);
  std::vector<double> p(5, 1.0);
  CHECK_THROWS_WITH_AS(bound.step(std::span<double>(p), std::span<const double>(g)), doctest::Contains("bound to 0"),
                       gradsync::InvalidArgument);
  CHECK(p == std::vector<double>(5, 1.0));
  // Steps taken but no momentum or moments: the next step would start from
  // zeros under a later step's rule.
  const auto view = fresh.state();
  gradsync::OptimizerState<double> hollow{view.steps, {}, {}};
  for (const auto& h : view.hyperparameters) hollow.hyperparameters.push_back(h.second);
  hollow.buffers.resize(view.buffers.size());
  Opt loaded = make();
  CHECK_THROWS_WITH_AS(loaded.load_state(hollow), doctest::Contains("holds no buffers"), gradsync::InvalidArgument);
  std::vector<double> lent(loaded.state_per_element() * 5);
  loaded.bind_state(std::span<double>(lent), 5);
  CHECK_THROWS_WITH_AS(loaded.load_state(hollow), doctest::Contains("holds no buffers"), gradsync::InvalidArgument);
}

}  // namespace test_train_optimizers
