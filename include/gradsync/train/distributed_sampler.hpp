#pragma once
/// \file DistributedSampler: each rank's share of a dataset's indices, by PyTorch's rules.

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <string>
#include <vector>

#include "gradsync/core/error.hpp"

namespace gradsync {

/// Options of DistributedSampler, with PyTorch's defaults.
struct SamplerOptions {
  bool shuffle = true;
  std::uint64_t seed = 0;
  /// Drop the tail so every rank gets the same number of distinct samples,
  /// instead of padding with repeats.
  bool drop_last = false;
};

/// Rank `rank`'s indices into a dataset of `length` samples, as
/// torch.utils.data.DistributedSampler chooses them:
/// - num_samples = ⌈L/N⌉, or ⌈(L−N)/N⌉ with drop_last when N does not divide L;
/// - the order is 0..L−1, or with shuffle a permutation seeded by seed + epoch;
/// - without drop_last the list is padded to num_samples·N by repeating it
///   from the start (cycling if it is shorter than the padding); with
///   drop_last it is cut to num_samples·N;
/// - rank r takes positions r, r+N, r+2N, ...
///
/// The permutation is a Fisher–Yates shuffle driven by std::mt19937_64 with
/// an exactly specified bounded draw, so every rank (and every process built
/// by any conforming compiler) computes the same one. It is not torch's
/// permutation for the same seed.
class DistributedSampler {
 public:
  DistributedSampler(std::size_t length, int num_replicas, int rank, SamplerOptions options = {})
      : length_(length), replicas_(num_replicas), rank_(rank), o_(options) {
    if (num_replicas < 1) {
      throw InvalidArgument("gradsync: DistributedSampler expects num_replicas >= 1, got " +
                            std::to_string(num_replicas));
    }
    if (rank < 0 || rank >= num_replicas) {
      throw InvalidArgument("gradsync: DistributedSampler expects rank in [0, " + std::to_string(num_replicas) +
                            "), got " + std::to_string(rank));
    }
    const auto n = static_cast<std::size_t>(num_replicas);
    if (o_.drop_last && length % n != 0) {
      // ⌈(L−N)/N⌉ is ⌊L/N⌋ when N∤L, and 0 when L < N.
      num_samples_ = length / n;
    } else {
      num_samples_ = (length + n - 1) / n;
    }
  }

  /// Selects the permutation of the next epoch (seed + epoch); call it at
  /// the start of every epoch, with the same value on every rank.
  void set_epoch(std::uint64_t epoch) noexcept { epoch_ = epoch; }
  std::uint64_t epoch() const noexcept { return epoch_; }

  /// Indices this rank visits in the current epoch.
  std::size_t num_samples() const noexcept { return num_samples_; }
  /// num_samples() * num_replicas: the padded or trimmed length.
  std::size_t total_size() const noexcept { return num_samples_ * static_cast<std::size_t>(replicas_); }

  /// This rank's indices for the current epoch.
  std::vector<std::size_t> indices() const {
    std::vector<std::size_t> all(length_);
    std::iota(all.begin(), all.end(), std::size_t{0});
    if (o_.shuffle) shuffle(all, o_.seed + epoch_);
    const std::size_t total = total_size();
    if (all.size() < total) {
      const std::size_t original = all.size();
      while (all.size() < total) all.push_back(all[(all.size() - original) % original]);
    } else {
      all.resize(total);
    }
    std::vector<std::size_t> mine;
    mine.reserve(num_samples_);
    for (std::size_t i = static_cast<std::size_t>(rank_); i < total; i += static_cast<std::size_t>(replicas_)) {
      mine.push_back(all[i]);
    }
    return mine;
  }

 private:
  static void shuffle(std::vector<std::size_t>& v, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (std::size_t i = v.size(); i > 1; --i) {
      // Unbiased draw in [0, i) by rejection; std::uniform_int_distribution's
      // algorithm is left to the implementation, which would let ranks built
      // differently disagree.
      const std::uint64_t bound = i;
      const std::uint64_t limit = std::uint64_t(-1) - std::uint64_t(-1) % bound;
      std::uint64_t x;
      do x = rng();
      while (x >= limit);
      std::swap(v[i - 1], v[static_cast<std::size_t>(x % bound)]);
    }
  }

  std::size_t length_;
  int replicas_;
  int rank_;
  SamplerOptions o_;
  std::size_t num_samples_ = 0;
  std::uint64_t epoch_ = 0;
};

}  // namespace gradsync
