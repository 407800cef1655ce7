#pragma once
/// \file detail::OptimizerStateStorage: an optimizer's per-element buffers, in
/// vectors of its own or in storage a trainer lends it (bind_state).

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/core/error.hpp"

namespace gradsync::detail {

/// The per-element buffers of an optimizer (Sgd's velocity, Adam's two
/// moments): `slots` buffers of one length. They live in vectors of the
/// optimizer's own until a trainer lends it storage (bind), as an
/// offloaded ShardedTrainer does with an allocation of its OffloadSpace;
/// from then on they are slices of that storage, for as long as it lives.
/// A copy owns its values: a copy of a bound optimizer holds them in
/// vectors, bound to nothing, so two optimizers never step one storage.
///
/// Each own buffer starts `lead(k)` elements into its vector, a different
/// number of bytes past a page boundary for each slot. glibc maps every
/// large vector on its own pages, at the same offset in a page, and places
/// one below the last: at 16 M float parameters the parameters, gradients
/// and both moments of an Adam step then lie exactly 64 MiB + 4 KiB apart,
/// and on this 2-core VM an Adam step there took about 1.5 times as long
/// (at 32 M, 2 to 2.8 times) as with the moments' starts moved by a few
/// hundred bytes, while 17 M was hardly affected
/// (bench/results/optim_step_state_stagger.txt, docs/PERFORMANCE.md).
template <class T>
class OptimizerStateStorage {
 public:
  explicit OptimizerStateStorage(std::size_t slots) : own_(slots) {}
  OptimizerStateStorage(const OptimizerStateStorage& o) : own_(o.slots()) {
    for (std::size_t k = 0; k < slots(); ++k) own(k, o.buffer(k));
  }
  OptimizerStateStorage(OptimizerStateStorage&& o) noexcept
      : own_(std::move(o.own_)), lent_(std::exchange(o.lent_, {})), n_(std::exchange(o.n_, 0)),
        bound_(std::exchange(o.bound_, false)) {}
  OptimizerStateStorage& operator=(const OptimizerStateStorage& o) {
    if (this != &o) *this = OptimizerStateStorage(o);
    return *this;
  }
  OptimizerStateStorage& operator=(OptimizerStateStorage&& o) noexcept {
    own_ = std::move(o.own_);
    lent_ = std::exchange(o.lent_, {});
    n_ = std::exchange(o.n_, 0);
    bound_ = std::exchange(o.bound_, false);
    return *this;
  }
  ~OptimizerStateStorage() = default;

  std::size_t slots() const noexcept { return own_.size(); }
  bool bound() const noexcept { return bound_; }
  /// Elements per buffer: bound, the length it was bound for; else 0
  /// before the first step or load.
  std::size_t size() const noexcept { return bound_ ? n_ : (own_.empty() ? 0 : buffer(0).size()); }
  /// Elements held in the optimizer's own vectors (none once bound).
  std::size_t own_elements() const noexcept {
    std::size_t n = 0;
    for (std::size_t k = 0; k < slots(); ++k) n += bound_ ? 0 : buffer(k).size();
    return n;
  }

  std::span<T> buffer(std::size_t k) noexcept {
    if (bound_) return lent_.subspan(k * n_, n_);
    return own_[k].empty() ? std::span<T>() : std::span<T>(own_[k]).subspan(lead(k));
  }
  std::span<const T> buffer(std::size_t k) const noexcept {
    if (bound_) return std::span<const T>(lent_).subspan(k * n_, n_);
    return own_[k].empty() ? std::span<const T>() : std::span<const T>(own_[k]).subspan(lead(k));
  }

  /// Every buffer n zeros (bound: n is its length, which the step checked).
  void zero(std::size_t n) {
    if (bound_) {
      std::ranges::fill(lent_, T(0));
      return;
    }
    for (std::size_t k = 0; k < slots(); ++k) own_[k].assign(lead(k) + n, T(0));
  }

  /// Back to "no state": own vectors emptied; lent storage zeroed, since it stays.
  void clear() noexcept {
    if (bound_) {
      std::ranges::fill(lent_, T(0));
      return;
    }
    for (auto& b : own_) b.clear();
  }

  /// Throws InvalidArgument unless `buffers` can replace these: bound, each
  /// must have the bound length (or be empty: no state yet).
  void check_assign(const char* who, const std::vector<std::vector<T>>& buffers) const {
    if (!bound_) return;
    for (const auto& b : buffers) {
      if (!b.empty() && b.size() != n_) {
        throw InvalidArgument(std::string("gradsync: ") + who + "::load_state: its state is bound to " +
                              std::to_string(n_) + " elements per buffer (the span its trainer steps), got " +
                              std::to_string(b.size()));
      }
    }
  }

  /// Replaces the values, after check_assign: own vectors take a copy of
  /// each buffer as it is (an empty or missing one: no state); lent storage copies
  /// them, an empty one as zeros.
  void assign(std::vector<std::vector<T>>&& buffers) {
    if (!bound_) {
      // Fewer buffers than slots: an Sgd without momentum lists none.
      for (std::size_t k = 0; k < slots(); ++k) {
        own(k, k < buffers.size() ? std::span<const T>(buffers[k]) : std::span<const T>());
      }
      return;
    }
    for (std::size_t k = 0; k < slots(); ++k) {
      const std::span<T> to = buffer(k);
      if (buffers[k].empty()) {
        std::ranges::fill(to, T(0));
      } else {
        std::ranges::copy(buffers[k], to.begin());
      }
    }
  }

  /// Keeps the buffers in `storage` from now on, for a span of
  /// `elements` parameters: slots()·elements values, which the caller
  /// keeps alive while this optimizer steps. What is held moves into it
  /// (it must be for `elements` then); otherwise it starts zeroed.
  void bind(const char* who, std::span<T> storage, std::size_t elements) {
    if (storage.size() != slots() * elements) {
      throw InvalidArgument(std::string("gradsync: ") + who + "::bind_state expects " +
                            std::to_string(slots()) + " x " + std::to_string(elements) + " elements of storage, got " +
                            std::to_string(storage.size()));
    }
    const std::size_t held = size();
    if (held != 0 && held != elements) {
      throw InvalidArgument(std::string("gradsync: ") + who + "::bind_state for " + std::to_string(elements) +
                            " elements, but its state belongs to a span of " + std::to_string(held) +
                            " (call reset() first)");
    }
    for (std::size_t k = 0; k < slots(); ++k) {
      const std::span<T> to = storage.subspan(k * elements, elements);
      const std::span<const T> from = buffer(k);
      if (from.empty()) {
        std::ranges::fill(to, T(0));
      } else {
        std::ranges::copy(from, to.begin());
      }
    }
    // The vectors' memory goes now: the state must not be held twice.
    for (auto& b : own_) std::vector<T>().swap(b);
    lent_ = storage;
    n_ = elements;
    bound_ = true;
  }

 private:
  /// Where buffer k starts in its vector: 512 bytes further for each slot
  /// (a multiple of 64 bytes, so a vector's alignment is kept).
  static constexpr std::size_t lead(std::size_t k) noexcept { return (k + 1) * (512 / sizeof(T)); }
  /// Own buffer k becomes a copy of `values` (empty: none).
  void own(std::size_t k, std::span<const T> values) {
    if (values.empty()) {
      own_[k].clear();
      return;
    }
    own_[k].assign(lead(k) + values.size(), T(0));
    std::ranges::copy(values, own_[k].begin() + static_cast<std::ptrdiff_t>(lead(k)));
  }

  std::vector<std::vector<T>> own_;
  std::span<T> lent_;
  std::size_t n_ = 0;
  bool bound_ = false;
};

}  // namespace gradsync::detail
