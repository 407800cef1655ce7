#pragma once
// Which sanitizer a test binary is built under, for the suites that run a
// smaller sample there (GCC defines __SANITIZE_*; Clang answers
// __has_feature).

namespace test {

#if defined(__SANITIZE_THREAD__)
inline constexpr bool under_tsan = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool under_tsan = true;
#else
inline constexpr bool under_tsan = false;
#endif
#else
inline constexpr bool under_tsan = false;
#endif

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool under_asan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool under_asan = true;
#else
inline constexpr bool under_asan = false;
#endif
#else
inline constexpr bool under_asan = false;
#endif

/// Built with TSan or ASan: runs slower, by 2-15x.
inline constexpr bool sanitized = under_tsan || under_asan;

}  // namespace test
