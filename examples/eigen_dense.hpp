#pragma once
// <Eigen/Dense> for the examples and bench/ddp_step, which are built with
// -march=native (meson option native_arch), and with EIGEN_USE_BLAS where
// OpenBLAS is installed (meson.build says why). With AVX-512, GCC 12 warns
// inside its own intrinsics header once Eigen's packet code is inlined: the
// "undefined" vectors it initialises from themselves (GCC bug 105593), and
// 64-byte loads on paths it cannot see are dead for vectors shorter than
// 16 floats. A diagnostic pragma covers the header where it is first
// included, so these warnings go and those in our own code stay.

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Warray-bounds"
#endif
#include <Eigen/Dense>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#if defined(EXAMPLES_OPENBLAS)
// OpenBLAS would split each product over a thread per core; here every rank
// owns its core, as PyTorch's peers run with torch.set_num_threads(1).
extern "C" void openblas_set_num_threads(int);
namespace example::detail {
inline const bool blas_on_one_thread = (openblas_set_num_threads(1), true);
}  // namespace example::detail
#endif
