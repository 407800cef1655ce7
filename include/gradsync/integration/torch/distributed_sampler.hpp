#pragma once
/// \file TorchDistributedSampler: gradsync::DistributedSampler as a LibTorch data-loader sampler.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

// The sampler interface and its archives, not all of <torch/torch.h>
// (about half the time to parse).
#include <torch/data/samplers/base.h>
#include <torch/serialize/archive.h>

#include "gradsync/core/error.hpp"
#include "gradsync/train/data/distributed_sampler.hpp"

namespace gradsync {

/// Feeds a LibTorch data loader this rank's share of the dataset, chosen by
/// gradsync::DistributedSampler (PyTorch's DistributedSampler rules, the
/// same permutation on every rank and platform):
///
///     auto loader = torch::data::make_data_loader(
///         dataset.map(torch::data::transforms::Stack<>()),
///         gradsync::TorchDistributedSampler(dataset.size().value(), comm.size(), comm.rank()),
///         torch::data::DataLoaderOptions(64));
///     for (int epoch = 0; epoch < epochs; ++epoch)
///       for (auto& batch : *loader) ...
///
/// The loader owns its sampler and restarts it at every pass (begin()), so
/// the epoch advances there: the first pass is the start epoch, each later
/// pass the next one, as calling set_epoch(epoch) every epoch does in
/// PyTorch. save()/load() keep the epoch and the position within it, and
/// the pass after a load() resumes there instead of starting over, at the
/// same world size or another that can continue the epoch (load()).
///
/// LibTorch's own DistributedRandomSampler draws another permutation (from
/// torch's generator); this one visits what gradsync's trainers visit.
class TorchDistributedSampler final : public torch::data::samplers::Sampler<std::vector<std::size_t>> {
 public:
  TorchDistributedSampler(std::size_t length, int num_replicas, int rank, SamplerOptions options = {})
      : replicas_(num_replicas), rank_(rank), o_(options), sampler_(length, num_replicas, rank, options) {
    set_epoch(0);
  }

  /// Selects the epoch of the next pass (before handing the sampler to a loader).
  void set_epoch(std::uint64_t epoch) {
    sampler_.set_epoch(epoch);
    indices_ = sampler_.indices();
    next_ = 0;
    started_ = false;
  }
  std::uint64_t epoch() const noexcept { return sampler_.epoch(); }
  /// Indices this rank visits per epoch.
  std::size_t num_samples() const noexcept { return sampler_.num_samples(); }

  /// The loader's start of a pass: the next epoch (the start epoch on the
  /// first pass, or where load() left off). A new size rebuilds the sampler
  /// for it, with the same ranks, seed and epoch.
  void reset(torch::optional<std::size_t> new_size = torch::nullopt) override {
    if (new_size) {
      const std::uint64_t epoch = sampler_.epoch();
      sampler_ = DistributedSampler(*new_size, replicas_, rank_, o_);
      sampler_.set_epoch(epoch);
      indices_ = sampler_.indices();
      next_ = 0;
    }
    if (started_) set_epoch(sampler_.epoch() + 1);
    started_ = true;
  }

  /// The next `batch_size` indices of this rank's share (fewer at the end),
  /// or nothing when the epoch is done.
  torch::optional<std::vector<std::size_t>> next(std::size_t batch_size) override {
    if (next_ >= indices_.size()) return torch::nullopt;
    const std::size_t n = std::min(batch_size, indices_.size() - next_);
    std::vector<std::size_t> batch(indices_.begin() + static_cast<std::ptrdiff_t>(next_),
                                   indices_.begin() + static_cast<std::ptrdiff_t>(next_ + n));
    next_ += n;
    return batch;
  }

  /// Saves what DistributedSampler::state() holds (LibTorch's archive
  /// format): the seed, the epoch, the samples all ranks have taken of it,
  /// and the dataset's length, shuffle and drop_last, which load() checks.
  /// Every rank's archive is the same where ranks are at the same position.
  void save(torch::serialize::OutputArchive& archive) const override {
    const SamplerState s = state();
    auto write = [&](const char* key, std::uint64_t value) {
      archive.write(key, torch::tensor(static_cast<std::int64_t>(value)), /*is_buffer=*/true);
    };
    write("epoch", s.epoch);
    write("position", next_);  // this rank's: all an archive of an earlier version holds
    write("seed", s.seed);
    write("consumed", s.consumed);
    write("length", s.length);
    write("shuffle", s.shuffle ? 1 : 0);
    write("drop_last", s.drop_last ? 1 : 0);
  }

  /// Resumes where save() left off, at any world size that
  /// DistributedSampler::load_state accepts: the same dataset (length,
  /// shuffle, drop_last) and a number of samples taken that this world size
  /// divides, or the whole epoch. Anything else throws InvalidArgument, so a
  /// loader never silently visits samples again or skips them. An archive of
  /// an earlier version (epoch and this rank's position only) loads as it
  /// did then, unchecked: it must come from the same world size and dataset.
  void load(torch::serialize::InputArchive& archive) override {
    auto read = [&](const char* key) -> std::optional<std::uint64_t> {
      torch::Tensor value = torch::empty({}, torch::kInt64);
      if (!archive.try_read(key, value, /*is_buffer=*/true)) return std::nullopt;
      return static_cast<std::uint64_t>(value.item<std::int64_t>());
    };
    const auto epoch = read("epoch");
    const auto position = read("position");
    if (!epoch || !position) {
      throw InvalidArgument("gradsync: TorchDistributedSampler::load: the archive holds no sampler state "
                            "(no 'epoch' and 'position'); was it written by TorchDistributedSampler::save?");
    }
    if (const auto consumed = read("consumed")) {
      const auto seed = read("seed"), length = read("length"), shuffle = read("shuffle"), drop_last = read("drop_last");
      if (!seed || !length || !shuffle || !drop_last) {
        throw InvalidArgument("gradsync: TorchDistributedSampler::load: the archive has 'consumed' but lacks one of "
                              "'seed', 'length', 'shuffle', 'drop_last'");
      }
      sampler_.load_state({*seed, *epoch, *consumed, *length, *shuffle != 0, *drop_last != 0});
      o_.seed = *seed;
      indices_ = sampler_.indices();
      next_ = sampler_.position();
    } else {
      set_epoch(*epoch);
      if (*position > indices_.size()) {
        throw InvalidArgument("gradsync: TorchDistributedSampler::load: position " + std::to_string(*position) +
                              " is past this rank's " + std::to_string(indices_.size()) + " samples");
      }
      next_ = static_cast<std::size_t>(*position);
    }
    // The loader's next begin() resets: let that pass resume here.
    started_ = false;
  }

  /// What save() writes: DistributedSampler::state() at this pass's position.
  SamplerState state() const noexcept { return sampler_.state_at(next_); }

 private:
  int replicas_;
  int rank_;
  SamplerOptions o_;
  DistributedSampler sampler_;
  std::vector<std::size_t> indices_;
  std::size_t next_ = 0;
  bool started_ = false;  ///< a pass of the current epoch has begun
};


}  // namespace gradsync
