#pragma once
/// \file detail::StepLabels: the labels a trainer puts on its collectives
/// (which step, which unit or bucket, what for) and their words in errors.
///
/// A collective's count says how much moves, not what: two ranks that
/// gather units of equal size in a different order, or reduce bucket 2 on
/// one rank while another reduces bucket 3, would combine unrelated data
/// and train a wrong model without a word. Each label packs the step, the
/// phase and the unit into the 64-bit id that ranks compare as part of the
/// call, and the value every rank must hold in that call (the learning
/// rate; clip_grad_norm's max_norm) into its setting.

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gradsync/core/call_label.hpp"

namespace gradsync::detail {

/// What a trainer's collective is for.
enum class LabelPhase : std::uint8_t {
  buffers = 1,     ///< the buffers' broadcast from rank 0
  gather,          ///< a unit's all-gather
  reduce,          ///< a unit's gradient reduction (reduce-scatter, or all-reduce unsharded)
  replica_reduce,  ///< HybridShard: a unit's shard summed across replica groups
  bucket,          ///< a bucket's all-reduce (GradSync)
  clip,            ///< clip_grad_norm's norm; the index holds p, the setting max_norm
  check,           ///< a replica check or another whole-model collective
  nonfinite,       ///< the agreement on finite gradient and loss; the index counts the step's micro-batches
  lr_changed,      ///< the agreement on a learning rate set between forward_backward() and optimizer_step()
  entry,           ///< the world agreement that starts a call (HybridShard's in groups; a save); index: TrainerEntry
  micro_batches,   ///< OnNonfinite::ignore: the agreement on the step's micro-batch count, which the index holds
  parameters,      ///< a broadcast of rank 0's parameters (fully_shard's sync_module_states)
};

/// Which public call a LabelPhase::entry label starts.
enum class TrainerEntry : std::uint8_t {
  forward_backward = 1,
  accumulate,
  evaluate,
  full_parameters,
  checkpoint_save,  ///< save_checkpoint, AsyncCheckpointer::save: what every rank's step and rate are
};

inline const char* entry_name(TrainerEntry e) noexcept {
  switch (e) {
    case TrainerEntry::forward_backward: return "forward_backward()";
    case TrainerEntry::accumulate: return "accumulate()";
    case TrainerEntry::evaluate: return "evaluate()";
    case TrainerEntry::full_parameters: return "full_parameters()";
    case TrainerEntry::checkpoint_save: return "a checkpoint's save";
  }
  return "a call";
}

/// The shortest text that reads back as `x` ("0.1", "1e-05").
inline std::string shortest(double x) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

inline std::uint64_t bits_of(double x) noexcept {
  std::uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

inline double double_of(std::uint64_t b) noexcept {
  double x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

/// One trainer's labels: id = trainer (8 bits) | step (24) | phase (8) |
/// index (24), the trainer counted from 0 on its communicator, the step
/// from 1, both wrapping, which only ever compares equal
/// numbers; setting = the bits of a double (`setting_name`, e.g. "optimizer
/// lr"). Ranks agree on `names` at construction, so each rank reads a
/// peer's label with its own table.
class StepLabels final : public LabelNames {
 public:
  /// `step_word`: "step" (a trainer) or "sync" (GradSync, which counts
  /// synced backwards); `unit_word`: what an index names ("wrapped unit",
  /// "bucket"); `names[i]`: index i in words ("'fc2'").
  StepLabels(std::string step_word, std::string unit_word, std::vector<std::string> names, std::string setting_name)
      : step_word_(std::move(step_word)),
        unit_word_(std::move(unit_word)),
        names_(std::move(names)),
        setting_name_(std::move(setting_name)) {}
  StepLabels(const StepLabels&) = delete;
  StepLabels& operator=(const StepLabels&) = delete;

  /// `k`: which trainer of its communicator these labels are (0 for the
  /// first), folded into the top 8 bits of the step, whose 24 left suffice.
  void set_ordinal(std::uint32_t k) noexcept { ordinal_ = k & 0xffu; }

  CallLabel label(LabelPhase phase, std::size_t index, std::uint64_t step, std::uint64_t setting) const noexcept {
    CallLabel l = pack(phase, index, (step & 0xffffffu) | std::uint64_t{ordinal_} << 24);
    l.setting = setting;
    l.names = this;
    return l;
  }

  /// The label's id alone (no setting, no names): for a caller whose
  /// table of names grows, so that it reads labels with a StepLabels made then.
  static CallLabel pack(LabelPhase phase, std::size_t index, std::uint64_t step) noexcept {
    const std::uint64_t id = (step & 0xffffffffu) << 32 | static_cast<std::uint64_t>(phase) << 24 | (index & 0xffffffu);
    return CallLabel{id, 0, nullptr};
  }

  /// clip_grad_norm's label: p's float bits (its top 24: every p anyone
  /// uses, 1, 2 or infinity, fits) and max_norm.
  CallLabel clip_label(std::uint64_t step, double max_norm, double p) const noexcept {
    const float pf = static_cast<float>(p);
    std::uint32_t pb;
    std::memcpy(&pb, &pf, sizeof pb);
    return label(LabelPhase::clip, pb >> 8, step, bits_of(max_norm));  // label() adds the ordinal
  }

  std::string describe(std::uint64_t id, std::uint64_t setting) const override {
    const auto step = id >> 32 & 0xffffff, ordinal = id >> 56;
    const auto phase = static_cast<LabelPhase>(id >> 24 & 0xff);
    const std::size_t index = id & 0xffffff;
    std::string s = ordinal == 0 ? "" : "trainer " + std::to_string(ordinal + 1) + " of its communicator, ";
    s += step_word_ + " " + std::to_string(step) + ", ";
    switch (phase) {
      case LabelPhase::buffers: s += "broadcast of the buffers"; break;
      case LabelPhase::parameters: s += "broadcast of the parameters"; break;
      case LabelPhase::gather: s += "all-gather of " + unit(index); break;
      case LabelPhase::reduce: s += "gradient reduction of " + unit(index); break;
      case LabelPhase::replica_reduce: s += "replica-group sum of " + unit(index); break;
      case LabelPhase::bucket: s += "all-reduce of " + unit(index); break;
      case LabelPhase::check: s += "whole-model check"; break;
      case LabelPhase::nonfinite:
        s += "agreement on finite gradients and loss";
        if (index > 1) s += " of " + std::to_string(index) + " micro-batches";
        break;
      case LabelPhase::micro_batches:
        s += "agreement on the step's count of " + std::to_string(index) + " micro-batch" + (index == 1 ? "" : "es");
        break;
      case LabelPhase::lr_changed: s += "agreement on a learning rate set after forward_backward()"; break;
      case LabelPhase::entry: s += std::string("start of ") + entry_name(static_cast<TrainerEntry>(index)); break;
      case LabelPhase::clip: {
        const auto pb = static_cast<std::uint32_t>(index) << 8;
        float p;
        std::memcpy(&p, &pb, sizeof p);
        return s + "clip_grad_norm(max_norm = " + shortest(double_of(setting)) + ", p = " + shortest(p) + ")";
      }
      default: s += "phase " + std::to_string(static_cast<int>(phase)) + " of index " + std::to_string(index);
    }
    if (setting != 0) s += ", " + setting_name_ + " " + shortest(double_of(setting));
    return s;
  }

 private:
  std::string unit(std::size_t index) const {
    std::string s = unit_word_ + " " + std::to_string(index);
    if (index < names_.size() && !names_[index].empty()) s += " (" + names_[index] + ")";
    return s;
  }

  std::string step_word_, unit_word_;
  std::vector<std::string> names_;
  std::string setting_name_;
  std::uint32_t ordinal_ = 0;
};

}  // namespace gradsync::detail
