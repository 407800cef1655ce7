#pragma once
// What ddp_step and fsdp_step share: their common flags, the models they
// time, and a rank's random batch.

// First: eigen_dense.hpp's pragma reaches the intrinsics header only if nothing included it before.
#include "../examples/eigen_mlp.hpp"
#include "int_list.hpp"

#include <gradsync/train/common/on_nonfinite.hpp>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

/// "MLP 784-1024-1024-10 (1.86M params)".
inline std::string describe(const std::vector<int>& sizes) {
  std::string name = "MLP ";
  std::size_t params = 0;
  for (std::size_t l = 0; l < sizes.size(); ++l) {
    name += (l ? "-" : "") + std::to_string(sizes[l]);
    if (l + 1 < sizes.size()) params += std::size_t(sizes[l] + 1) * std::size_t(sizes[l + 1]);
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, " (%.2fM params)", static_cast<double>(params) / 1e6);
  return name + buf;
}

/// The flags both tools take: --backend --steps --ranks --sizes --large-only --small-only --on-nonfinite.
struct StepOptions {
  int steps = 0;
  std::vector<int> ranks{1, 2, 4}, sizes;
  bool small = true, large = true, ranks_given = false;
  std::string backend = "threads";
  /// Each value --on-nonfinite lists, timed in turn; the trainers' default alone without it.
  std::vector<gradsync::OnNonfinite> on_nonfinite{gradsync::OnNonfinite::throw_error};
  /// --on-nonfinite was given: rows end with the value they ran under.
  bool on_nonfinite_given = false;

  /// The models to time: --sizes, or the 1.86M and 10.0M MLPs.
  std::vector<std::vector<int>> models() const {
    if (!sizes.empty()) return {sizes};
    std::vector<std::vector<int>> m;
    if (small) m.push_back({784, 1024, 1024, 10});
    if (large) m.push_back({784, 2048, 2048, 2048, 10});
    return m;
  }
};

/// Prints why and the usage line, and exits 2.
[[noreturn]] inline void usage(const char* program, const char* usage_text, const std::string& why) {
  std::fprintf(stderr, "%s: %s\n%s", program, why.c_str(), usage_text);
  std::exit(2);
}

/// "throw_error,ignore": OnNonfinite values, comma-separated; `fail(why)` on a bad one.
template <class Fail>
std::vector<gradsync::OnNonfinite> parse_on_nonfinite(const std::string& text, Fail&& fail) {
  std::vector<gradsync::OnNonfinite> out;
  std::stringstream ss(text);
  for (std::string t; std::getline(ss, t, ',');) {
    bool known = false;
    for (const auto o : {gradsync::OnNonfinite::throw_error, gradsync::OnNonfinite::skip_step,
                         gradsync::OnNonfinite::ignore}) {
      if (t == gradsync::name(o)) out.push_back(o), known = true;
    }
    if (!known) fail("--on-nonfinite takes throw_error, skip_step or ignore, comma-separated, not '" + t + "'");
  }
  if (out.empty()) fail("--on-nonfinite needs a value");
  return out;
}

/// Parses the common flags; `extra(key, value_or_null, consumed)` gets any
/// other flag first and returns whether it knew it (`consumed` set when it
/// took the value). Bad input prints `usage_text` and exits 2.
template <class Extra>
StepOptions parse_step_options(int argc, char** argv, const char* program, const char* usage_text, int steps,
                               Extra extra) {
  StepOptions o;
  o.steps = steps;
  auto fail = [&](const std::string& why) { usage(program, usage_text, why); };
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const bool has_value = i + 1 < argc;
    try {
      bool consumed = false;
      if (extra(k, has_value ? argv[i + 1] : nullptr, consumed)) {
        i += consumed ? 1 : 0;
      } else if (k == "--steps" && has_value) {
        o.steps = parse_list(argv[++i], "--steps").at(0);
      } else if (k == "--ranks" && has_value) {
        o.ranks = parse_list(argv[++i], "--ranks");
        o.ranks_given = true;
      } else if (k == "--sizes" && has_value) {
        o.sizes = parse_list(argv[++i], "--sizes");
        if (o.sizes.size() < 2) fail("--sizes needs at least an input and an output width");
      } else if (k == "--backend" && has_value) {
        o.backend = argv[++i];
      } else if (k == "--on-nonfinite" && has_value) {
        o.on_nonfinite = parse_on_nonfinite(argv[++i], fail);
        o.on_nonfinite_given = true;
      } else if (k == "--large-only") {
        o.small = false;
      } else if (k == "--small-only") {
        o.large = false;
      } else {
        const bool takes_value =
            k == "--steps" || k == "--ranks" || k == "--sizes" || k == "--backend" || k == "--on-nonfinite";
        fail(takes_value ? k + " needs a value" : "unknown option " + k);
      }
    } catch (const std::logic_error&) {
      fail("bad value for " + k + ": '" + argv[i] + "' (positive integers, comma-separated)");
    }
  }
  if (o.backend != "threads" && o.backend != "mpi") fail("unknown backend '" + o.backend + "' (threads or mpi)");
#ifndef GRADSYNC_HAVE_MPI
  if (o.backend == "mpi") {
    fail(std::string("--backend mpi: this ") + program +
         " was built without MPI; install it (e.g. libopenmpi-dev) and reconfigure with meson option -Dmpi=enabled");
  }
#endif
  if (o.backend == "mpi" && o.ranks_given) fail("--ranks is for threads; under --backend mpi the world size is mpirun's -np");
  return o;
}

/// A batch of 64 normal samples with random labels, drawn from the rank's own seed.
class RandomBatch {
 public:
  static constexpr int size = 64;
  RandomBatch(const std::vector<int>& sizes, int rank)
      : x_(std::size_t(size) * std::size_t(sizes[0])), y_(size) {
    std::mt19937 rng(5 + static_cast<unsigned>(rank));
    std::normal_distribution<float> normal;
    for (float& v : x_) v = normal(rng);
    for (int& v : y_) v = static_cast<int>(rng() % static_cast<unsigned>(sizes.back()));
  }
  RandomBatch(const RandomBatch&) = delete;
  RandomBatch& operator=(const RandomBatch&) = delete;
  example::Batch batch() const { return {x_.data(), y_.data(), size}; }

 private:
  std::vector<float> x_;
  std::vector<int> y_;
};

}  // namespace bench
