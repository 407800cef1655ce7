#pragma once
/// \file Request: the handle of one non-blocking collective.

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <utility>

#include "gradsync/core/error.hpp"
#include "gradsync/core/rank_names.hpp"

namespace gradsync {

namespace detail {

/// Shared between whoever runs the collective and whoever waits for it.
struct RequestState {
  std::mutex mutex;
  std::condition_variable cv;
  bool started = false;
  bool done = false;
  std::chrono::steady_clock::time_point start_time{};
  std::exception_ptr error;
  std::string label;  ///< what the request does, for a timeout message
  int rank = -1;
  RankNames names;  ///< how the timeout message names `rank`

  void start() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      started = true;
      start_time = std::chrono::steady_clock::now();
    }
    cv.notify_all();
  }
  void complete(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      done = true;
      error = std::move(e);
    }
    cv.notify_all();
  }
};

}  // namespace detail

/// A collective in flight. `wait()` blocks until it completes and rethrows
/// its exception if it failed; `test()` asks without blocking. Every wait
/// has a deadline: the communicator's timeout after the collective started,
/// plus a grace period, so that the collective's own (more precise) timeout
/// error normally arrives first. A request that has not started yet is
/// queued behind others, each of which is bounded the same way.
class Request {
 public:
  /// Extra time past the communicator's timeout before wait() gives up on
  /// its own; the collective reports its own timeout well within it.
  static constexpr std::chrono::seconds grace{5};

  Request() = default;
  Request(std::shared_ptr<detail::RequestState> state, std::chrono::nanoseconds timeout)
      : state_(std::move(state)), timeout_(timeout) {}

  /// False for a default-constructed request.
  bool valid() const noexcept { return state_ != nullptr; }

  /// True once the collective has completed; rethrows its exception if it
  /// failed. An invalid request counts as complete.
  bool test() const {
    if (!state_) return true;
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->done && state_->error) std::rethrow_exception(state_->error);
    return state_->done;
  }

  /// Blocks until the collective completes; rethrows its exception, or
  /// throws Timeout if it ran past its deadline.
  void wait() const {
    if (!state_) return;
    std::unique_lock<std::mutex> lock(state_->mutex);
    for (;;) {
      if (state_->done) break;
      if (state_->started) {
        const auto deadline = state_->start_time + timeout_ + grace;
        if (!state_->cv.wait_until(lock, deadline, [&] { return state_->done; })) {
          throw Timeout("gradsync: " + state_->names.who(state_->rank) + ": request '" + state_->label +
                        "' did not complete within the communicator's timeout (" +
                        std::to_string(std::chrono::duration<double>(timeout_).count()) + " s) after it started");
        }
      } else {
        state_->cv.wait(lock, [&] { return state_->done || state_->started; });
      }
    }
    if (state_->error) std::rethrow_exception(state_->error);
  }

 private:
  std::shared_ptr<detail::RequestState> state_;
  std::chrono::nanoseconds timeout_{};
};

namespace detail {

/// Waits until `r` is over, whatever it throws: even past its deadline a job
/// still uses its owner's buffers until it returns, so an owner that unwinds
/// (GradSync, ShardedTrainer) must not free them before this returns.
inline void settle(const Request& r) noexcept {
  try {
    r.wait();
    return;
  } catch (...) {
  }
  for (;;) {
    try {
      if (r.test()) return;
    } catch (...) {
      return;  // completed, with an error
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace detail
}  // namespace gradsync
