#pragma once
/// \file detail::agree_to_save: the start of a checkpoint's save on every
/// rank, refusing ranks whose samplers differ.

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "gradsync/core/error.hpp"
#include "gradsync/train/common/hash_bytes.hpp"
#include "gradsync/train/data/distributed_sampler.hpp"

namespace gradsync::detail {

/// Collective: the trainer's save agreement (TrainerBase::agree_to_save,
/// which also compares step counts and learning rates) with a hash of the
/// sampler's state, on the ranks that pass one. A checkpoint records one
/// sampler state, rank 0's, so ranks whose samplers differ (a seed, a
/// forgotten set_epoch, another position or dataset length) would resume
/// with one order that not all of them had: every rank throws
/// InvalidArgument, naming its own state, before anything is written.
/// `what` names the save in the message.
template <class Trainer>
void agree_to_save(Trainer& trainer, const DistributedSampler* sampler, const std::string& what) {
  std::optional<std::uint64_t> h;
  SamplerState s;
  if (sampler) {
    s = sampler->state();
    const std::array<std::uint64_t, 5> words{s.seed, s.epoch, s.consumed, s.length,
                                             std::uint64_t{s.shuffle} | std::uint64_t{s.drop_last} << 1};
    h = hash_bytes(words.data(), sizeof words, 0x9b05688c2b3e6c1full);
  }
  if (trainer.agree_to_save(h)) return;
  const std::string mine =
      sampler ? "this rank's: seed " + std::to_string(s.seed) + ", epoch " + std::to_string(s.epoch) + ", " +
                    std::to_string(s.consumed) + " positions taken of " + std::to_string(s.length) +
                    " samples, shuffle " + (s.shuffle ? "on" : "off") + ", drop_last " + (s.drop_last ? "on" : "off")
              : "this rank passed none";
  throw InvalidArgument("gradsync: " + what + " on rank " + std::to_string(trainer.communicator().rank()) +
                        ": the ranks' DistributedSamplers differ, and a checkpoint records one (" + mine +
                        "). Give every rank's sampler the same length, options and seed, call set_epoch on every "
                        "rank, and take as many batches on each; nothing was saved");
}

}  // namespace gradsync::detail
