#pragma once
/// \file ProgressWorker: non-blocking collectives on one communicator.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/request.hpp"
#include "gradsync/core/trace_recorder.hpp"

namespace gradsync {

/// Runs collectives on one communicator from a dedicated thread, in the
/// order they were submitted, and hands back a Request for each.
///
/// Why a thread: a Communicator is single-threaded, and the Threads
/// transport only moves data while a rank is inside a collective (the
/// receiver copies out of the sender's buffer when it polls). For a
/// collective to advance while the rank's own thread runs backward, some
/// other thread must be inside it. One worker per communicator keeps the
/// collectives in one FIFO order on every rank, which is what makes them
/// match across ranks.
///
/// While any request is in flight the communicator belongs to the worker:
/// the owning thread must wait for every request before it issues a blocking
/// collective on the same communicator itself (in_flight() says whether it
/// must).
///
/// After a submitted collective fails, later ones are not run; their
/// requests fail with that first failure itself (its type and words).
template <Backend B>
class ProgressWorker {
 public:
  /// A private worker: it must then be the communicator's only one (no
  /// shared() worker, no GradSync on the same communicator while it lives).
  explicit ProgressWorker(Communicator<B>& comm) : comm_(comm), thread_([this] { loop(); }) {}
  ProgressWorker(const ProgressWorker&) = delete;
  ProgressWorker& operator=(const ProgressWorker&) = delete;

  /// Lets the running collective finish, fails the queued ones without
  /// running them (their peers are told through the backend when this rank
  /// unwinds), and joins the thread.
  ~ProgressWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  /// The worker of `comm`: made on first use, shared by every caller while
  /// any of them holds it, and gone (thread joined) when the last lets go.
  /// Jobs submitted through any holder run in submission order.
  static std::shared_ptr<ProgressWorker> shared(Communicator<B>& comm) {
    // Keyed by address: a Communicator cannot move while a worker refers to
    // it, and an entry whose worker expired is dropped before a new
    // communicator at the same address could find it.
    static std::mutex mutex;
    static std::vector<std::pair<const Communicator<B>*, std::weak_ptr<ProgressWorker>>> registry;
    std::lock_guard<std::mutex> lock(mutex);
    std::erase_if(registry, [](const auto& entry) { return entry.second.expired(); });
    for (const auto& [c, weak] : registry) {
      if (c == &comm) {
        if (auto worker = weak.lock()) return worker;
      }
    }
    auto worker = std::make_shared<ProgressWorker>(comm);
    registry.emplace_back(&comm, worker);
    return worker;
  }

  Communicator<B>& communicator() noexcept { return comm_; }

  /// Queues `body(comm)` and returns at once. `label` names the work in a
  /// timeout message.
  template <class F>
  Request submit(std::string label, F&& body) {
    auto state = std::make_shared<detail::RequestState>();
    state->label = std::move(label);
    state->rank = comm_.rank();
    state->names = detail::rank_names(comm_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(Task{state, std::function<void(Communicator<B>&)>(std::forward<F>(body))});
      ++in_flight_;
    }
    cv_.notify_all();
    return Request(std::move(state), comm_.timeout());
  }

  /// Requests submitted and not yet completed.
  std::size_t in_flight() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return in_flight_;
  }

  /// Seconds the worker has spent running collectives, summed.
  double busy_seconds() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return busy_seconds_;
  }

 private:
  struct Task {
    std::shared_ptr<detail::RequestState> state;
    std::function<void(Communicator<B>&)> body;
  };

  void loop() {
    // Its collectives go on a track of its own in the rank's timeline, beside the rank's thread.
    detail::trace_thread_name() = "progress worker";
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Task task = std::move(queue_.front());
      queue_.pop_front();
      std::exception_ptr error;
      if (failure_) {
        // The failure itself, not a wrapper: whichever request its owner
        // waits on first, it learns what went wrong, as the type it was
        // (a disagreement stays InvalidArgument on every rank).
        error = failure_;
      } else if (stop_) {
        error = std::make_exception_ptr(Aborted("gradsync: " + detail::who(comm_) + ": '" +
                                                task.state->label +
                                                "' was not run because its ProgressWorker was destroyed first"));
      } else {
        lock.unlock();
        task.state->start();
        const auto t0 = std::chrono::steady_clock::now();
        try {
          task.body(comm_);
        } catch (...) {
          error = std::current_exception();
          lock.lock();
          failure_ = error;
          lock.unlock();
        }
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        lock.lock();
        busy_seconds_ += dt;
      }
      --in_flight_;
      // Completed under the lock, so in_flight() == 0 implies every request
      // is done and the communicator is the owner's again.
      task.state->complete(std::move(error));
    }
  }

  Communicator<B>& comm_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  std::size_t in_flight_ = 0;
  double busy_seconds_ = 0;
  bool stop_ = false;
  std::exception_ptr failure_;  ///< the first task's failure: every later task fails with it
  std::thread thread_;  // last: starts after every member it reads exists
};

}  // namespace gradsync
