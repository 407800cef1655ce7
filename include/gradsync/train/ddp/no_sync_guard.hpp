#pragma once
/// \file detail::NoSyncGuard: what GradSync::no_sync() and DistributedDataParallel::no_sync() return.

namespace gradsync::detail {

/// Synchronisation off while the guard lives, and back to what it was after:
/// backward then only accumulates locally, and the next synced backward
/// reduces the sum (PyTorch's `no_sync()`). S has `bool sync_enabled() const`
/// and `void set_sync(bool)`.
template <class S>
class NoSyncGuard {
 public:
  explicit NoSyncGuard(S& s) : s_(s), was_(s.sync_enabled()) { s_.set_sync(false); }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  ~NoSyncGuard() { s_.set_sync(was_); }

 private:
  S& s_;
  bool was_;
};

}  // namespace gradsync::detail
