#pragma once
/// \file detail::LabelScope: labels the collectives a caller starts on a
/// communicator while it lives, without a label in each primitive's Options.
///
/// The trainers label what they move (a unit, a bucket, the step) around
/// collectives that a reduction policy or a user's hook makes for them, so
/// the label reaches calls whose code knows nothing of trainers.

#include "gradsync/core/backend.hpp"
#include "gradsync/core/call_label.hpp"
#include "gradsync/core/communicator.hpp"

namespace gradsync::detail {

/// While it lives, every collective on `comm` whose Options carry no label
/// of their own carries `label`. Scopes nest; the outer label comes back.
template <Backend B>
class LabelScope {
 public:
  LabelScope(Communicator<B>& comm, CallLabel label) noexcept : comm_(comm), outer_(comm.label_) {
    comm.label_ = label;
  }
  LabelScope(const LabelScope&) = delete;
  LabelScope& operator=(const LabelScope&) = delete;
  ~LabelScope() { comm_.label_ = outer_; }

 private:
  Communicator<B>& comm_;
  CallLabel outer_;
};

}  // namespace gradsync::detail
