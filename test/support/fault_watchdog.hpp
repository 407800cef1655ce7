#pragma once
// A watchdog for randomized trials: armed with a budget and a description
// before each trial, disarmed after it. A trial that outlives its budget is
// a hang; the watchdog prints the description (with the trial's seed) and
// ends the process with std::_Exit(1), so CI reports a failure that replays
// instead of waiting out the test's own timeout.

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace test {

class Watchdog {
 public:
  Watchdog() : thread_([this] { watch(); }) {}
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  /// Starts the clock on one trial; `what` is printed if it runs out.
  void arm(std::chrono::duration<double> budget, std::string what) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      deadline_ = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(budget);
      budget_s_ = budget.count();
      what_ = std::move(what);
      armed_ = true;
    }
    cv_.notify_all();
  }

  void disarm() {
    std::lock_guard<std::mutex> lock(mutex_);
    armed_ = false;
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      if (!armed_) {
        cv_.wait(lock);
        continue;
      }
      if (cv_.wait_until(lock, deadline_) == std::cv_status::timeout && armed_ && !stop_ &&
          std::chrono::steady_clock::now() >= deadline_) {
        std::fprintf(stderr, "\nWATCHDOG: a trial ran past its %.1f s budget (a hang): %s\n", budget_s_, what_.c_str());
        std::fflush(stderr);
        std::fflush(stdout);
        std::_Exit(1);
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::chrono::steady_clock::time_point deadline_{};
  double budget_s_ = 0;
  std::string what_;
  bool armed_ = false;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the state above exists
};

}  // namespace test
