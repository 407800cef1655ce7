#pragma once
// OnNonfinite, written once for both trainers: a NaN or Inf put into one
// rank's gradient (or loss) at a random step, unit and element must throw on
// every rank with the model as before the step, skip that update on every
// rank, or pass unnoticed, as the option says.

#include <gradsync/gradsync.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace test_nonfinite {

/// One rank's batch: every parameter is pulled towards a multiple of `target`;
/// `unit` ≥ 0 overwrites element `element` of that unit's gradient with `bad`,
/// and `bad_loss` makes the loss NaN.
struct Batch {
  double target = 0;
  int unit = -1;
  std::size_t element = 0;
  float bad = 0;
  bool bad_loss = false;
};

/// Units of the given sizes; loss ½Σ(p_i − target·(1 + i mod 5))².
struct Model {
  using value_type = float;
  std::vector<std::size_t> sizes;

  std::vector<gradsync::UnitSpec> units() const {
    std::vector<gradsync::UnitSpec> u;
    for (std::size_t i = 0; i < sizes.size(); ++i) u.push_back({"n" + std::to_string(i), {{"w", {sizes[i]}}}, {}});
    return u;
  }
  void bind(std::span<const gradsync::UnitView<float>> views) {
    for (const auto& unit : views)
      for (std::size_t i = 0; i < unit.flat_params.size(); ++i) unit.flat_params[i] = 0.05f * float(i % 7) - 0.1f;
  }
  double forward_backward(const Batch& b, const gradsync::StepContext<float>& ctx) {
    auto diff = [&](float x, std::size_t i) { return x - static_cast<float>(b.target * double(1 + i % 5)); };
    // A sharded trainer's first ask of a unit is its forward, the second its backward.
    double loss = 0;
    for (std::size_t u = 0; u < sizes.size(); ++u) {
      const auto p = ctx.params(u);
      for (std::size_t i = 0; i < p->flat_params.size(); ++i) {
        const float d = diff(p->flat_params[i], i);
        loss += 0.5 * double(d) * double(d);
      }
    }
    for (std::size_t u = sizes.size(); u-- > 0;) {
      const auto p = ctx.params(u);
      for (std::size_t i = 0; i < p->flat_params.size(); ++i) p->flat_grads[i] += diff(p->flat_params[i], i);
      if (b.unit == static_cast<int>(u)) p->flat_grads[b.element] = b.bad;
      ctx.ready(u);
    }
    return b.bad_loss ? std::numeric_limits<double>::quiet_NaN() : loss;
  }
};

inline const std::vector<std::size_t> sizes{7, 12, 5, 9};
constexpr int steps = 4;

/// Where and what to break, drawn from `g`.
struct Poison {
  int world = 3, rank = 0, step = 0, unit = -1;
  std::size_t element = 0;
  float value = 0;
  bool loss = false;
};

inline Poison draw(std::mt19937_64& g) {
  Poison p;
  p.world = std::uniform_int_distribution<int>(3, 5)(g);
  p.rank = std::uniform_int_distribution<int>(0, p.world - 1)(g);
  p.step = std::uniform_int_distribution<int>(0, steps - 2)(g);
  p.loss = std::uniform_int_distribution<int>(0, 4)(g) == 0;
  if (!p.loss) {
    p.unit = std::uniform_int_distribution<int>(0, static_cast<int>(sizes.size()) - 1)(g);
    p.element = std::uniform_int_distribution<std::size_t>(0, sizes[static_cast<std::size_t>(p.unit)] - 1)(g);
    const float values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
    p.value = values[std::uniform_int_distribution<int>(0, 2)(g)];
  }
  return p;
}

inline std::string describe(const Poison& p) {
  return "world " + std::to_string(p.world) + ", rank " + std::to_string(p.rank) + ", step " +
         std::to_string(p.step) + (p.loss ? ", NaN loss" : ", unit " + std::to_string(p.unit) + " element " +
                                                               std::to_string(p.element) + " = " +
                                                               std::to_string(p.value));
}

/// Rank r's batch of step s, poisoned where `p` says (`poisoned` false: never).
inline Batch batch_for(const Poison& p, int r, int s, bool poisoned) {
  Batch b{.target = 0.3 * (r + 1) + 0.1 * s};
  if (poisoned && r == p.rank && s == p.step) {
    b.unit = p.unit;
    b.element = p.element;
    b.bad = p.value;
    b.bad_loss = p.loss;
  }
  return b;
}

/// What one rank saw.
struct Seen {
  std::vector<std::string> errors;  ///< per step, "" if it did not throw
  std::vector<float> local_before, local_after, state_before, state_after;
  std::uint64_t opt_steps_before = 0, opt_steps_after = 0;
  std::vector<float> final_params;
  std::size_t step_count = 0, skipped = 0;
};

/// Runs `steps` steps on p.world ranks; with `poisoned`, p's step is broken
/// (with `reference`, that step is left out instead). `make(comm)` builds the
/// trainer, `local(t)` is its own storage, `full(t)` every parameter.
template <class Make, class Local, class Full>
std::vector<Seen> run(const Poison& p, bool poisoned, bool reference, Make make, Local local, Full full) {
  std::vector<Seen> seen(static_cast<std::size_t>(p.world));
  gradsync::run_threads(p.world, [&](gradsync::Communicator<gradsync::Threads>& comm) {
    Seen& me = seen[static_cast<std::size_t>(comm.rank())];
    auto t = make(comm);
    auto state = [&] {
      const auto s = t.optimizer().state();
      std::vector<float> v;
      for (const auto& [name, data] : s.buffers) v.insert(v.end(), data.begin(), data.end());
      return std::pair(s.steps, v);
    };
    for (int s = 0; s < steps; ++s) {
      if (reference && s == p.step) continue;
      const bool bad = s == p.step;
      if (bad) {
        const auto l = local(t);
        me.local_before.assign(l.begin(), l.end());
        std::tie(me.opt_steps_before, me.state_before) = state();
      }
      std::string error;
      try {
        t.step(batch_for(p, comm.rank(), s, poisoned));
      } catch (const gradsync::Error& e) {
        error = e.what();
      }
      me.errors.push_back(error);
      if (bad) {
        const auto l = local(t);
        me.local_after.assign(l.begin(), l.end());
        std::tie(me.opt_steps_after, me.state_after) = state();
      }
    }
    me.final_params = full(t);
    me.step_count = t.step_count();
    me.skipped = t.stats().skipped_steps;
  });
  return seen;
}

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](float x, float y) {
           return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y);
         });
}

/// Checks every OnNonfinite policy under `make_for(policy)`; `unit_name(u)`
/// is how the trainer's error names unit u.
template <class MakeFor, class Local, class Full, class Name>
void check_policies(const Poison& p, MakeFor make_for, Local local, Full full, Name unit_name) {
  using gradsync::OnNonfinite;
  INFO(describe(p));
  const auto ref = run(p, false, true, make_for(OnNonfinite::throw_error), local, full);
  for (const OnNonfinite policy : {OnNonfinite::throw_error, OnNonfinite::skip_step, OnNonfinite::ignore}) {
    INFO("on_nonfinite = " << gradsync::name(policy));
    const auto seen = run(p, true, false, make_for(policy), local, full);
    for (std::size_t r = 0; r < seen.size(); ++r) {
      CAPTURE(r);
      const Seen& s = seen[r];
      REQUIRE(s.errors.size() == std::size_t(steps));
      for (int k = 0; k < steps; ++k) {
        if (k == p.step && policy == OnNonfinite::throw_error) continue;
        CHECK(s.errors[static_cast<std::size_t>(k)] == "");
      }
      if (policy == OnNonfinite::ignore) {
        if (!p.loss) {
          CHECK(std::any_of(s.final_params.begin(), s.final_params.end(), [](float x) { return !std::isfinite(x); }));
        }
        continue;
      }
      // The model is as the reference left it, which never took the bad step.
      CHECK(bitwise_equal(s.final_params, ref[r].final_params));
      CHECK(bitwise_equal(s.local_after, s.local_before));
      CHECK(bitwise_equal(s.state_after, s.state_before));
      CHECK(s.opt_steps_after == s.opt_steps_before);
      if (policy == OnNonfinite::throw_error) {
        const std::string& e = s.errors[static_cast<std::size_t>(p.step)];
        CHECK(e.find("step " + std::to_string(p.step + 1) + " went non-finite") != std::string::npos);
        if (p.loss) {
          CHECK(e.find("rank " + std::to_string(p.rank) + "'s loss") != std::string::npos);
        } else {
          CHECK(e.find(unit_name(static_cast<std::size_t>(p.unit)) + " holds a NaN or an Inf") != std::string::npos);
        }
        CHECK(s.step_count == std::size_t(steps - 1));
        CHECK(s.skipped == 0);
      } else {
        CHECK(s.step_count == std::size_t(steps));
        CHECK(s.skipped == 1);
      }
    }
  }
}

}  // namespace test_nonfinite
