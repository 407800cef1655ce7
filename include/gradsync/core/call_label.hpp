#pragma once
/// \file CallLabel: what a collective call moves, in the caller's terms, so
/// that ranks agree on it as they agree on its count.

#include <cstdint>
#include <string>

namespace gradsync {

/// Puts a CallLabel's two words into the caller's terms for an error
/// message ("step 7, all-gather of unit 'fc2'"). It is used on the rank that
/// writes the message, for its own label and for a peer's, so every rank
/// must be able to read every other rank's words the same way (a trainer's
/// table of units, which ranks agree on at construction).
class LabelNames {
 public:
  virtual std::string describe(std::uint64_t id, std::uint64_t setting) const = 0;

 protected:
  LabelNames() = default;
  LabelNames(const LabelNames&) = default;
  LabelNames& operator=(const LabelNames&) = default;
  ~LabelNames() = default;
};

/// What a call moves, beyond its count and type: ranks whose labels differ
/// disagree on the call, exactly as if their counts differed, and every rank
/// throws InvalidArgument naming both labels. Without one, two ranks that
/// pass equal counts for different data (unit 3's gradients on one, unit 5's
/// on the other) would combine them without a word.
///
/// `id` says what moves (a trainer packs the step, the unit and the phase);
/// `setting` is a value every rank must hold at this call (a trainer folds
/// its learning rate's bits into the first call of a step). Both 0: no
/// label. `names` is local to this rank and never compared.
struct CallLabel {
  std::uint64_t id = 0;
  std::uint64_t setting = 0;
  const LabelNames* names = nullptr;

  bool empty() const noexcept { return id == 0 && setting == 0; }
  /// The words ranks compare; `names` is this rank's own.
  bool same_as(const CallLabel& o) const noexcept { return id == o.id && setting == o.setting; }

  /// "step 7, all-gather of unit 'fc2'" through `names_to_use`, or
  /// "label 0x…" without names; empty for no label.
  std::string describe(const LabelNames* names_to_use) const {
    if (empty()) return {};
    if (names_to_use) return names_to_use->describe(id, setting);
    static constexpr char hex[] = "0123456789abcdef";
    auto word = [](std::uint64_t w) {
      std::string s = "0x";
      for (int i = 60; i >= 0; i -= 4) s += hex[(w >> i) & 0xf];
      return s;
    };
    std::string s = "label " + word(id);
    if (setting) s += " / " + word(setting);
    return s;
  }
};

}  // namespace gradsync
