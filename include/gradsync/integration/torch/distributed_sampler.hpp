#pragma once
/// \file TorchDistributedSampler: gradsync::DistributedSampler as a LibTorch data-loader sampler.

#include <algorithm>
#include <cstddef>
#include <cstdint>
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
/// the pass after a load() resumes there instead of starting over.
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

  /// Saves the epoch and the position within it (LibTorch's archive format).
  void save(torch::serialize::OutputArchive& archive) const override {
    archive.write("epoch", torch::tensor(static_cast<std::int64_t>(sampler_.epoch())), /*is_buffer=*/true);
    archive.write("position", torch::tensor(static_cast<std::int64_t>(next_)), /*is_buffer=*/true);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::Tensor epoch = torch::empty({}, torch::kInt64);
    torch::Tensor position = torch::empty({}, torch::kInt64);
    archive.read("epoch", epoch, /*is_buffer=*/true);
    archive.read("position", position, /*is_buffer=*/true);
    set_epoch(static_cast<std::uint64_t>(epoch.item<std::int64_t>()));
    // The loader's next begin() resets: let that pass resume here.
    started_ = false;
    const auto pos = static_cast<std::size_t>(position.item<std::int64_t>());
    if (pos > indices_.size()) {
      throw InvalidArgument("gradsync: TorchDistributedSampler::load: position " + std::to_string(pos) +
                            " is past this rank's " + std::to_string(indices_.size()) + " samples");
    }
    next_ = pos;
  }

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
