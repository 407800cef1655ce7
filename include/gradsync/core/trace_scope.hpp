#pragma once
/// \file detail::TraceScope: one phase of a trainer on its rank's timeline, from the scope's start to its end.

#include <cstdint>

#include "gradsync/core/trace_recorder.hpp"

namespace gradsync::detail {

/// Marks `kind` (of index `index`) on `trace` while it lives, on the
/// calling thread's track. With no timeline (`trace` null) it reads no
/// clock and records nothing.
class TraceScope {
 public:
  TraceScope(TraceRecorder* trace, TraceKind kind, std::uint64_t index = 0) noexcept
      : trace_(trace), index_(index), kind_(kind) {
    if (trace_) begin_ = TraceRecorder::now_ns();
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;
  ~TraceScope() {
    if (trace_) trace_->phase(kind_, index_, begin_, TraceRecorder::now_ns());
  }

 private:
  TraceRecorder* trace_;
  std::uint64_t index_;
  std::int64_t begin_ = 0;
  TraceKind kind_;
};

}  // namespace gradsync::detail
