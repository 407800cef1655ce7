#pragma once
// What the training-checkpoint tests share: a temporary directory, batches
// drawn through a DistributedSampler, the optimizers they resume, what a
// refused load threw on each rank, a byte flipped in a file, and the names
// they use unqualified.

#include <doctest/doctest.h>
#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/checkpoint_options.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "support/temp_dir.hpp"
#include "test_train_model.hpp"

namespace test_checkpoint {

namespace fs = std::filesystem;

using test::TempDir;

/// What one rank's load got: its exception's type and message ("" if none).
struct LoadOutcome {
  std::string type, what;
};

/// Runs `load()` and returns what a refused load threw; any other exception propagates.
template <class Load>
LoadOutcome outcome_of(Load load) {
  try {
    load();
  } catch (const gradsync::InvalidArgument& e) {
    return {"InvalidArgument", e.what()};
  } catch (const gradsync::Error& e) {
    return {"Error", e.what()};
  }
  return {};
}

/// Every rank threw (a `type` exception, unless it is empty: any), and
/// every message names each of `parts` (the file, the tensor).
inline void all_say(const std::vector<LoadOutcome>& got, const std::string& type,
                    const std::vector<std::string>& parts) {
  for (const LoadOutcome& o : got) {
    CAPTURE(o.what);
    if (type.empty()) {
      CHECK(!o.type.empty());
    } else {
      CHECK(o.type == type);
    }
    for (const std::string& p : parts) CHECK(o.what.find(p) != std::string::npos);
  }
}

/// What one rank's save did: "" if it returned, else its exception (FileError with its path and errno).
struct SaveOutcome {
  std::string type, what, path;
  int os_error = 0;
};

template <class Save>
SaveOutcome save_outcome_of(Save save) {
  try {
    save();
  } catch (const gradsync::FileError& e) {
    return {"FileError", e.what(), e.path(), e.os_error()};
  } catch (const gradsync::InvalidArgument& e) {
    return {"InvalidArgument", e.what(), "", 0};
  } catch (const gradsync::Error& e) {
    return {"Error", e.what(), "", 0};
  } catch (const std::exception& e) {
    return {"not a gradsync::Error", e.what(), "", 0};
  }
  return {};
}

/// Flips one bit of the byte at offset `at` of `file`, in place.
inline void flip_byte(const fs::path& file, std::uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(at));
  char c = 0;
  f.get(c);
  f.seekp(std::streamoff(at));
  f.put(static_cast<char>(c ^ 0x10));
}

/// Options under which either trainer's runs are bitwise repeatable.
inline gradsync::ReplicatedTrainerOptions exact_replicated() {
  gradsync::ReplicatedTrainerOptions o;
  o.sync.collective.deterministic = true;
  return o;
}
inline gradsync::ShardedTrainerOptions exact_sharded() {
  gradsync::ShardedTrainerOptions o;
  o.collective.deterministic = true;
  return o;
}

inline gradsync::Sgd<float> momentum_sgd(double lr = 0.1) {
  return gradsync::Sgd<float>({.lr = lr, .momentum = 0.9, .weight_decay = 1e-3});
}
inline gradsync::Adam<float> adam(double lr = 0.01) {
  return gradsync::Adam<float>({.lr = lr, .weight_decay = 1e-4});
}

/// A batch of the samples `idx` names, `in` inputs and `out` targets each.
inline test_train::Batch<float> batch_of(std::span<const std::size_t> idx, std::size_t in, std::size_t out) {
  test_train::Batch<float> b;
  for (std::size_t i : idx) {
    const test_train::Batch<float> one = test_train::make_batch<float>(i, 1, in, out);
    b.x.insert(b.x.end(), one.x.begin(), one.x.end());
    b.y.insert(b.y.end(), one.y.begin(), one.y.end());
  }
  b.size = idx.size();
  return b;
}

/// `steps` steps of at most `b` samples, drawn from the sampler in order;
/// a new epoch starts when the current one is used up.
template <class Trainer>
void train_steps(Trainer& trainer, gradsync::DistributedSampler& sampler, int steps, std::size_t b, std::size_t in,
                 std::size_t out, std::vector<std::size_t>* seen = nullptr) {
  for (int s = 0; s < steps; ++s) {
    if (sampler.position() == sampler.num_samples()) sampler.set_epoch(sampler.epoch() + 1);
    const auto idx = sampler.indices();
    const std::size_t n = std::min(b, sampler.num_samples() - sampler.position());
    const std::span<const std::size_t> mine(idx.data() + sampler.position(), n);
    if (seen) seen->insert(seen->end(), mine.begin(), mine.end());
    trainer.step(batch_of(mine, in, out));
    sampler.advance(n);
  }
}

/// The names the checkpoint suites use unqualified, declared once: a test
/// file says `using namespace test_checkpoint::names;`.
namespace names {
using namespace test_train::names;
namespace fs = std::filesystem;
using gradsync::CheckpointFormat;
using test_checkpoint::adam;
using test_checkpoint::all_say;
using test_checkpoint::exact_replicated;
using test_checkpoint::exact_sharded;
using test_checkpoint::flip_byte;
using test_checkpoint::LoadOutcome;
using test_checkpoint::momentum_sgd;
using test_checkpoint::outcome_of;
using test_checkpoint::TempDir;
}  // namespace names

}  // namespace test_checkpoint
