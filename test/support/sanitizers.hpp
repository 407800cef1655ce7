#pragma once
// Which sanitizer a test binary is built under, for the suites that run a
// smaller sample there (GCC defines __SANITIZE_*; Clang answers
// __has_feature, which GCC 12 lacks).

#if defined(__has_feature)
#define GRADSYNC_TEST_HAS_FEATURE(x) __has_feature(x)
#else
#define GRADSYNC_TEST_HAS_FEATURE(x) 0
#endif

namespace test {

#if defined(__SANITIZE_THREAD__) || GRADSYNC_TEST_HAS_FEATURE(thread_sanitizer)
inline constexpr bool under_tsan = true;
#else
inline constexpr bool under_tsan = false;
#endif

#if defined(__SANITIZE_ADDRESS__) || GRADSYNC_TEST_HAS_FEATURE(address_sanitizer)
inline constexpr bool under_asan = true;
#else
inline constexpr bool under_asan = false;
#endif

/// Built with TSan or ASan: runs slower, by 2-15x.
inline constexpr bool sanitized = under_tsan || under_asan;

}  // namespace test
