// The cost model behind Auto: explain() lists every algorithm the backend has
// and names the cheapest; parse_cost_model reads GRADSYNC_COST_MODEL strictly.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/collectives.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_cost_model {

namespace gs = gradsync;

namespace {

constexpr gs::Collective collectives[] = {gs::Collective::all_reduce, gs::Collective::reduce_scatter,
                                          gs::Collective::all_gather, gs::Collective::broadcast};

/// explain() for every world size 1..9, on a communicator of that size.
std::vector<std::vector<gs::Explanation>> explain_all(gs::Collective c, const std::vector<std::size_t>& bytes) {
  std::vector<std::vector<gs::Explanation>> out(10);
  for (int n = 1; n <= 9; ++n) {
    gs::run_threads(n, [&](gs::Communicator<gs::Threads>& comm) {
      if (comm.rank() != 0) return;
      for (std::size_t b : bytes) out[static_cast<std::size_t>(n)].push_back(gs::explain(comm, c, b));
    });
  }
  return out;
}

const std::vector<std::size_t> sizes{0, 4, 1000, 4096, 100'000, 1 << 20, 1 << 26};

}  // namespace

TEST_CASE("explain lists the four Threads algorithms, each with a finite prediction") {
  for (gs::Collective c : collectives) {
    const auto all = explain_all(c, sizes);
    for (int n = 1; n <= 9; ++n) {
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const gs::Explanation& e = all[static_cast<std::size_t>(n)][i];
        INFO(gs::name(c) << ", N = " << n << ", " << sizes[i] << " bytes, chosen " << e.chosen);
        REQUIRE(e.candidates.size() == 4);
        CHECK(e.candidates[0].algorithm == gs::Ring::name);
        CHECK(e.candidates[1].algorithm == gs::Tree::name);
        CHECK(e.candidates[2].algorithm == gs::RecursiveHalvingDoubling::name);
        CHECK(e.candidates[3].algorithm == gs::Native::name);
        for (const gs::Prediction& p : e.candidates) {
          CHECK(std::isfinite(p.seconds));
          CHECK(p.seconds >= 0.0);
        }
      }
    }
  }
}

TEST_CASE("explain prices all-reduce by the reference formulas and chooses their cheapest") {
  // Written out here from docs' Hockney formulas (shared REFERENCE.md), not
  // taken from predict(): messages below the chunk size (one chunk each) on
  // power-of-two worlds, where the formulas are exact. Tree is the
  // unpipelined double binary tree, 2 lg p messages and 2n bytes moved;
  // Native is two lg p synchronisations and one pass over the bytes.
  const gs::CostModel& m = gs::cost_model<gs::Threads>();
  const double a = m.alpha, b = m.beta, g = m.gamma;
  const double nb = m.native_beta > 0 ? m.native_beta : b;
  const std::vector<std::size_t> small{4, 4096, 65536};
  const auto all = explain_all(gs::Collective::all_reduce, small);
  for (int p : {2, 4, 8}) {
    const double lg = std::log2(p);
    const double frac = (p - 1.0) / p;
    for (std::size_t i = 0; i < small.size(); ++i) {
      const double n = static_cast<double>(small[i]);
      const double ring = 2 * (p - 1) * a + 2 * frac * n * b + frac * n * g;
      const double tree = 2 * lg * a + 2 * n * b + n * g;
      const double rabenseifner = 2 * lg * a + 2 * frac * n * b + frac * n * g;
      const double doubling = lg * (a + n * b + n * g);
      const double rhd = std::min(rabenseifner, doubling);
      const double native = 2 * m.native_alpha * lg + n * nb + frac * n * g;
      const std::vector<std::pair<std::string_view, double>> want{
          {gs::Ring::name, ring}, {gs::Tree::name, tree}, {gs::RecursiveHalvingDoubling::name, rhd},
          {gs::Native::name, native}};
      auto cheapest = want[0];
      for (const auto& w : want)
        if (w.second < cheapest.second) cheapest = w;
      const gs::Explanation& e = all[static_cast<std::size_t>(p)][i];
      INFO("N = " << p << ", " << small[i] << " bytes, chosen " << e.chosen);
      REQUIRE(e.candidates.size() == want.size());
      for (std::size_t k = 0; k < want.size(); ++k) {
        CAPTURE(want[k].first);
        CHECK(e.candidates[k].algorithm == want[k].first);
        CHECK(e.candidates[k].seconds == doctest::Approx(want[k].second).epsilon(1e-9));
      }
      CHECK(e.chosen == cheapest.first);
    }
  }
}

TEST_CASE("with one rank every prediction is zero") {
  for (gs::Collective c : collectives) {
    const auto all = explain_all(c, sizes);
    for (const gs::Explanation& e : all[1]) {
      INFO(gs::name(c));
      for (const gs::Prediction& p : e.candidates) CHECK(p.seconds == 0.0);
    }
  }
}

TEST_CASE("ring predictions grow with the bytes moved") {
  // Broadcast is left out: a pipelined chain of fixed-size chunks really is
  // faster just past a chunk boundary than exactly at it.
  std::vector<std::size_t> bytes;
  for (std::size_t b = 1024; b <= (std::size_t{1} << 28); b *= 2) bytes.push_back(b);
  for (gs::Collective c : {gs::Collective::all_reduce, gs::Collective::reduce_scatter, gs::Collective::all_gather}) {
    const auto all = explain_all(c, bytes);
    for (int n = 2; n <= 9; ++n) {
      const auto& row = all[static_cast<std::size_t>(n)];
      for (std::size_t i = 1; i < row.size(); ++i) {
        INFO(gs::name(c) << ", N = " << n << ": " << bytes[i - 1] << " -> " << bytes[i] << " bytes");
        CHECK(row[i].candidates[0].seconds > row[i - 1].candidates[0].seconds);
      }
    }
  }
}

TEST_CASE("parse_cost_model reads every key and keeps the base for keys not given") {
  const gs::CostModel base{.alpha = 1, .beta = 2, .gamma = 3, .native_alpha = 4, .chunk_bytes = 5};
  const gs::CostModel m =
      gs::detail::parse_cost_model("alpha=1e-6,beta=2.5e-10,gamma=3e-11,native_alpha=4e-7,chunk_bytes=65536", base);
  CHECK(m.alpha == 1e-6);
  CHECK(m.beta == 2.5e-10);
  CHECK(m.gamma == 3e-11);
  CHECK(m.native_alpha == 4e-7);
  CHECK(m.chunk_bytes == 65536);
  const gs::CostModel some = gs::detail::parse_cost_model("gamma=7,", base);
  CHECK(some.alpha == 1);
  CHECK(some.beta == 2);
  CHECK(some.gamma == 7);
  CHECK(some.native_alpha == 4);
  CHECK(some.chunk_bytes == 5);
  CHECK(gs::detail::parse_cost_model("", base).alpha == 1);
  const gs::CostModel eager = gs::detail::parse_cost_model("eager_bytes=4032,rendezvous_alpha=1.6e-6", base);
  CHECK(eager.eager_bytes == 4032);
  CHECK(eager.rendezvous_alpha == 1.6e-6);
  CHECK(eager.alpha == 1);
}

TEST_CASE("a message above the eager limit pays the rendezvous handshake") {
  const gs::CostModel plain{.alpha = 1e-6, .beta = 1e-10, .gamma = 1e-10};
  gs::CostModel m = plain;
  m.eager_bytes = 4096;
  m.rendezvous_alpha = 2e-6;
  CHECK(gs::detail::latency(4096, m) == 1e-6);
  CHECK(gs::detail::latency(4097, m) == 3e-6);
  CHECK(gs::detail::latency(1e9, plain) == 1e-6);  // eager_bytes 0: no switch
  // Ring at 2 ranks on 64 KiB: 2 messages of 32 KiB, each pays it once.
  const double n = 65536;
  CHECK(gs::detail::predict("ring", gs::Collective::all_reduce, 2, n, m) -
            gs::detail::predict("ring", gs::Collective::all_reduce, 2, n, plain) ==
        doctest::Approx(2 * 2e-6));
}

TEST_CASE("RecursiveHalvingDoubling takes the short path for small buffers only") {
  // Open MPI shared memory's constants (backend/mpi.hpp): at 2 ranks one
  // whole-buffer exchange beats two half-size ones while both pay the
  // handshake, up to about 16 KiB.
  const gs::CostModel m{.alpha = 0.5e-6, .beta = 3.3e-10, .gamma = 1.6e-10, .eager_bytes = 4032,
                        .rendezvous_alpha = 1.6e-6};
  for (int p = 2; p <= 9; ++p) {
    CAPTURE(p);
    CHECK(gs::detail::rhd_all_reduce_short(p, 8, m));
    CHECK_FALSE(gs::detail::rhd_all_reduce_short(p, 1 << 20, m));
    // What predict reports for rhd is what the algorithm will run.
    for (double n : {8.0, 4096.0, 16384.0, 1048576.0}) {
      CAPTURE(n);
      const double h = gs::detail::rhd_all_reduce_halving(p, n, m);
      const double d = gs::detail::rhd_all_reduce_doubling(p, n, m);
      CHECK(gs::detail::predict("rhd", gs::Collective::all_reduce, p, n, m) ==
            (gs::detail::rhd_all_reduce_short(p, n, m) ? d : h));
    }
  }
  CHECK(gs::detail::rhd_all_reduce_short(2, 12288, m));
  CHECK_FALSE(gs::detail::rhd_all_reduce_short(2, 65536, m));
}

TEST_CASE("native_beta prices the Native path on its own, and 0 falls back to beta") {
  gs::CostModel m{.alpha = 1e-6, .beta = 1e-10, .gamma = 1e-10, .native_alpha = 1e-6};
  const double n = 64.0 * (1 << 20);
  const double same = gs::detail::predict("native", gs::Collective::all_reduce, 4, n, m);
  m = gs::detail::parse_cost_model("native_beta=4e-10", m);
  CHECK(m.native_beta == 4e-10);
  const double slower = gs::detail::predict("native", gs::Collective::all_reduce, 4, n, m);
  // Only the per-byte term changes: by n * (native_beta - beta).
  CHECK(slower - same == doctest::Approx(n * 3e-10).epsilon(1e-9));
  // Ring does not depend on it.
  CHECK(gs::detail::predict("ring", gs::Collective::all_reduce, 4, n, m) ==
        gs::detail::predict("ring", gs::Collective::all_reduce, 4, n, gs::CostModel{.alpha = 1e-6, .beta = 1e-10, .gamma = 1e-10, .native_alpha = 1e-6}));
}

TEST_CASE("parse_cost_model rejects unknown keys and values that are not numbers") {
  const gs::CostModel base{};
  CHECK_THROWS_WITH_AS(gs::detail::parse_cost_model("alpah=1e-6", base), doctest::Contains("alpah"),
                       gs::InvalidArgument);
  CHECK_THROWS_WITH_AS(gs::detail::parse_cost_model("alpha=1e-6,bogus=2", base), doctest::Contains("bogus"),
                       gs::InvalidArgument);
  for (const std::string text : {"alpha=abc", "alpha=", "alpha=1e-6x", "beta=1,2", "alpha", "=1"}) {
    CAPTURE(text);
    CHECK_THROWS_AS(gs::detail::parse_cost_model(text, base), gs::InvalidArgument);
  }
  CHECK_THROWS_WITH_AS(gs::detail::parse_cost_model("alpha=abc", base), doctest::Contains("abc"),
                       gs::InvalidArgument);
}

TEST_CASE("parse_cost_model rejects values no cost model can have") {
  // A negative or NaN time makes Auto's choice meaningless, and converting a
  // negative or huge double to chunk_bytes (size_t) is undefined behaviour.
  const gs::CostModel base{};
  for (const std::string text : {"alpha=-1e-6", "beta=nan", "gamma=inf", "native_alpha=-1", "chunk_bytes=-4096",
                           "chunk_bytes=0", "chunk_bytes=1e30", "chunk_bytes=nan", "eager_bytes=-1",
                           "eager_bytes=4032.5", "eager_bytes=1e30", "rendezvous_alpha=-1e-6"}) {
    CAPTURE(text);
    CHECK_THROWS_AS(gs::detail::parse_cost_model(text, base), gs::InvalidArgument);
  }
}

namespace {
/// Stand-ins for a backend: cost_model<B>() reads B::cost_model and the
/// environment once per type, so each test gets a type of its own.
struct EnvProbe {
  static constexpr gs::CostModel cost_model{.alpha = 9, .beta = 8, .gamma = 7, .native_alpha = 6, .chunk_bytes = 5};
};
struct BadEnvProbe {
  static constexpr gs::CostModel cost_model{};
};
struct NoEnvProbe {
  static constexpr gs::CostModel cost_model{.alpha = 9, .beta = 8, .gamma = 7, .native_alpha = 6, .chunk_bytes = 5};
};

/// Sets an environment variable for one scope, then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};
}  // namespace

TEST_CASE("GRADSYNC_COST_MODEL overrides a backend's constants") {
  {
    const ScopedEnv env("GRADSYNC_COST_MODEL", "alpha=2e-6,chunk_bytes=4096");
    const gs::CostModel& m = gs::cost_model<EnvProbe>();
    CHECK(m.alpha == 2e-6);
    CHECK(m.beta == 8);
    CHECK(m.gamma == 7);
    CHECK(m.native_alpha == 6);
    CHECK(m.chunk_bytes == 4096);
  }
  {
    const ScopedEnv env("GRADSYNC_COST_MODEL", "alpha=fast");
    CHECK_THROWS_AS(gs::cost_model<BadEnvProbe>(), gs::InvalidArgument);
  }
  {
    const ScopedEnv env("GRADSYNC_COST_MODEL", nullptr);
    const gs::CostModel& m = gs::cost_model<NoEnvProbe>();
    CHECK(m.alpha == 9);
    CHECK(m.chunk_bytes == 5);
  }
}

}  // namespace test_cost_model
