#pragma once
/// \file Flush-to-zero for subnormal floats, per thread.
///
/// Arithmetic on subnormal floats (below about 1.2e-38 in float, 2.2e-308 in
/// double) is 10-100x slower on x86, where each such operation takes a
/// microcode assist. Training loops meet them when a value decays
/// geometrically: the momentum buffer of a parameter whose gradient stays
/// zero shrinks by the momentum (0.9) each step and is subnormal within a
/// thousand steps. This is what torch.set_flush_denormal(True) switches on.
/// The state lives in a per-thread floating-point control register: setting
/// it on one thread changes no other running thread, so each rank's thread
/// sets it for itself (a new thread starts with its creator's state, as
/// POSIX says of the floating-point environment, but a pool started earlier
/// does not see a later change).

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define GRADSYNC_DENORMALS_X86 1
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define GRADSYNC_DENORMALS_AARCH64 1
#endif

namespace gradsync {

namespace detail {

#if defined(GRADSYNC_DENORMALS_X86)
/// MXCSR bit 15 (FTZ: results that would be subnormal are zero) and bit 6
/// (DAZ: subnormal operands are read as zero).
inline constexpr std::uint64_t denormal_mask = (1u << 15) | (1u << 6);
inline std::uint64_t read_fp_control() noexcept { return _mm_getcsr(); }
inline void write_fp_control(std::uint64_t v) noexcept { _mm_setcsr(static_cast<unsigned>(v)); }
#elif defined(GRADSYNC_DENORMALS_AARCH64)
/// FPCR bit 24 (FZ): subnormal operands and results are zero, in single
/// and double precision.
inline constexpr std::uint64_t denormal_mask = std::uint64_t{1} << 24;
inline std::uint64_t read_fp_control() noexcept {
  std::uint64_t v;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(v));
  return v;
}
inline void write_fp_control(std::uint64_t v) noexcept { __asm__ __volatile__("msr fpcr, %0" : : "r"(v)); }
#else
inline constexpr std::uint64_t denormal_mask = 0;
inline std::uint64_t read_fp_control() noexcept { return 0; }
inline void write_fp_control(std::uint64_t) noexcept {}
#endif

/// This thread's flush bits (FTZ and DAZ on x86, FZ on aarch64); 0 elsewhere.
inline std::uint64_t denormal_bits() noexcept { return read_fp_control() & denormal_mask; }

/// Sets this thread's flush bits to `bits` (masked), leaving the rest of the
/// control register (rounding mode, exception masks) as it is.
inline void set_denormal_bits(std::uint64_t bits) noexcept {
  if constexpr (denormal_mask != 0) write_fp_control((read_fp_control() & ~denormal_mask) | (bits & denormal_mask));
}

}  // namespace detail

/// Sets (on) or clears (off) flush-to-zero and denormals-are-zero for the
/// calling thread, like torch.set_flush_denormal. Returns whether this
/// platform supports it (x86-64, aarch64); elsewhere it does nothing and
/// returns false. Only values below about 1.2e-38 (float) or 2.2e-308
/// (double) change: they become zero, and so do results that would be
/// subnormal. Per thread: call it on every rank's thread.
inline bool set_flush_denormals(bool on) noexcept {
  if constexpr (detail::denormal_mask == 0) {
    return false;
  } else {
    detail::set_denormal_bits(on ? detail::denormal_mask : 0);
    return true;
  }
}

/// Sets flush-to-zero (or clears it, with `on` false) on the calling thread
/// for its lifetime, and restores the thread's previous state when it ends.
/// Construct it at the top of each rank's body, on that rank's thread.
class FlushDenormals {
 public:
  explicit FlushDenormals(bool on = true) noexcept
      : previous_(detail::denormal_bits()), supported_(set_flush_denormals(on)) {}
  ~FlushDenormals() { detail::set_denormal_bits(previous_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

  /// Whether this platform can flush (see set_flush_denormals).
  bool supported() const noexcept { return supported_; }

 private:
  std::uint64_t previous_;
  bool supported_;
};

}  // namespace gradsync
