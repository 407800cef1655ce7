#pragma once
/// \file DistributedSampler: each rank's share of a dataset's indices, by PyTorch's rules.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <string>
#include <vector>

#include "gradsync/core/error.hpp"

namespace gradsync {

/// What a checkpoint keeps of a DistributedSampler: independent of the
/// world size, since the ranks' positions together cover a prefix of the
/// epoch's order.
struct SamplerState {
  std::uint64_t seed = 0;
  std::uint64_t epoch = 0;
  /// Positions of the epoch's (padded) order that all ranks together have
  /// taken: position() times the number of ranks; once the epoch is done,
  /// at least `length`, so that a finished epoch resumes finished at any
  /// world size (with drop_last, N ranks leave samples untaken that M ranks
  /// would take).
  std::uint64_t consumed = 0;
  /// The dataset's length, shuffle and drop_last: checked, not restored
  /// (another dataset is another run).
  std::uint64_t length = 0;
  bool shuffle = true;
  bool drop_last = false;
};

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
  /// the start of every epoch, with the same value on every rank. A new
  /// epoch starts at position 0; the epoch the sampler is already in keeps
  /// its position, so a loop that calls set_epoch at the top of every epoch
  /// resumes mid-epoch after load_state.
  void set_epoch(std::uint64_t epoch) noexcept {
    if (epoch != epoch_) position_ = 0;
    epoch_ = epoch;
  }
  std::uint64_t epoch() const noexcept { return epoch_; }

  /// How many of this epoch's indices() the training loop has used
  /// (advance()): where a loop resumed from a checkpoint starts.
  std::size_t position() const noexcept { return position_; }

  /// Records that the loop used the next `n` of this epoch's indices; a
  /// checkpoint saved afterwards resumes after them.
  void advance(std::size_t n) {
    if (n > num_samples_ - position_) {
      throw InvalidArgument("gradsync: DistributedSampler::advance(" + std::to_string(n) + ") at position " +
                            std::to_string(position_) + " of an epoch of " + std::to_string(num_samples_) +
                            " samples on rank " + std::to_string(rank_) + " goes past its end");
    }
    position_ += n;
  }

  /// What a checkpoint saves.
  SamplerState state() const noexcept { return state_at(position_); }

  /// What a checkpoint saves once `position` of this epoch's indices are
  /// used (for a loader that tracks its own position). A finished epoch
  /// saves at least `length` taken (SamplerState::consumed).
  SamplerState state_at(std::size_t position) const noexcept {
    const std::uint64_t consumed =
        position >= num_samples_ ? std::max<std::uint64_t>(length_, total_size())
                                 : static_cast<std::uint64_t>(position) * static_cast<std::uint64_t>(replicas_);
    return {o_.seed, epoch_, consumed, length_, o_.shuffle, o_.drop_last};
  }

  /// Throws InvalidArgument if `s` cannot be loaded here: another length,
  /// shuffle or drop_last, or a part of an epoch that this world size cannot
  /// continue without repeating or skipping a sample (not a multiple of it).
  void check_state(const SamplerState& s) const {
    auto refuse = [&](const std::string& what) {
      throw InvalidArgument("gradsync: DistributedSampler::load_state on rank " + std::to_string(rank_) + ": " + what);
    };
    if (s.length != length_ || s.shuffle != o_.shuffle || s.drop_last != o_.drop_last) {
      refuse("the state is of a sampler over " + std::to_string(s.length) + " samples (shuffle " +
             (s.shuffle ? "on" : "off") + ", drop_last " + (s.drop_last ? "on" : "off") + "), this one over " +
             std::to_string(length_) + " (shuffle " + (o_.shuffle ? "on" : "off") + ", drop_last " +
             (o_.drop_last ? "on" : "off") + ")");
    }
    // A prefix that covers the epoch (every sample, or this world size's
    // whole padded order) resumes at its end, whatever the world size.
    const bool whole = s.consumed >= length_ || s.consumed >= total_size();
    if (!whole && s.consumed % static_cast<std::uint64_t>(replicas_) != 0) {
      refuse(std::to_string(s.consumed) + " samples of epoch " + std::to_string(s.epoch) +
             " were taken, which " + std::to_string(replicas_) +
             " ranks cannot continue without repeating or skipping one (resume at a world size that divides it, "
             "or from the start of the next epoch)");
    }
  }

  /// Restores seed, epoch and position from a checkpoint (at any world size
  /// that divides the consumed count; check_state says what is refused).
  void load_state(const SamplerState& s) {
    check_state(s);
    o_.seed = s.seed;
    epoch_ = s.epoch;
    // A prefix that covers the epoch resumes at its end, as check_state
    // promises: also where this world size pads the order beyond the
    // samples taken (10 taken by 2 ranks, resumed by 4 whose epoch is 12),
    // so that no rank takes again the samples the saved run already used.
    const bool whole = s.consumed >= length_ || s.consumed >= total_size();
    position_ = whole ? num_samples_ : static_cast<std::size_t>(s.consumed / static_cast<std::uint64_t>(replicas_));
  }

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
  std::size_t position_ = 0;
};

}  // namespace gradsync
