#pragma once
// A line printed if the process crashes, for randomized tests whose inputs
// replay from a seed: doctest's crash report shows no INFO, and a sanitizer's
// report none of the test's own. While a CrashNote lives, a fatal signal or a
// sanitizer's death prints the latest note to stderr first; doctest's (or the
// sanitizer's) own report follows.

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <string_view>

#include "sanitizers.hpp"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || GRADSYNC_TEST_HAS_FEATURE(address_sanitizer) || \
    GRADSYNC_TEST_HAS_FEATURE(thread_sanitizer) || GRADSYNC_TEST_HAS_FEATURE(undefined_behavior_sanitizer)
#include <sanitizer/common_interface_defs.h>
#define GRADSYNC_TEST_SANITIZER_DEATH_CALLBACK 1
#endif

namespace test {

class CrashNote {
 public:
  CrashNote() {
    struct sigaction mine {};
    mine.sa_handler = &on_signal;
    sigemptyset(&mine.sa_mask);
    for (std::size_t i = 0; i < std::size(signals_); ++i) sigaction(signals_[i], &mine, &previous_[i]);
#ifdef GRADSYNC_TEST_SANITIZER_DEATH_CALLBACK
    __sanitizer_set_death_callback(&print);
#endif
  }
  CrashNote(const CrashNote&) = delete;
  CrashNote& operator=(const CrashNote&) = delete;
  ~CrashNote() {
#ifdef GRADSYNC_TEST_SANITIZER_DEATH_CALLBACK
    __sanitizer_set_death_callback(nullptr);
#endif
    for (std::size_t i = 0; i < std::size(signals_); ++i) sigaction(signals_[i], &previous_[i], nullptr);
    length_ = 0;
  }

  /// The note a crash prints from now on (its first 1000 bytes).
  void set(std::string_view note) {
    const std::size_t n = std::min(note.size(), sizeof(buffer_) - 1);
    length_ = 0;
    std::memcpy(buffer_, note.data(), n);
    buffer_[n] = '\n';
    length_ = n + 1;
  }

 private:
  static constexpr int signals_[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};

  // Only write() reads these in a handler; set() makes the note visible last.
  static inline char buffer_[1001];
  static inline volatile std::size_t length_ = 0;
  static inline struct sigaction previous_[std::size(signals_)];

  static void print() {
    static const char head[] = "\nCRASH NOTE: ";
    if (length_ == 0) return;
    if (::write(2, head, sizeof(head) - 1) > 0 && ::write(2, buffer_, length_) > 0) return;
  }

  // Prints the note, then hands the signal to whoever handled it before (doctest, or the default).
  static void on_signal(int sig) {
    print();
    for (std::size_t i = 0; i < std::size(signals_); ++i)
      if (signals_[i] == sig) sigaction(sig, &previous_[i], nullptr);
    std::raise(sig);
  }
};

}  // namespace test
