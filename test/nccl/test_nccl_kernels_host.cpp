// The Nccl backend's Thrust reduce/finish kernels, compiled for Thrust's CPP
// system with the host compiler and checked against core's reduce_into and
// finish for every element type and op, bit for bit. On a GPU the same
// functors run through thrust::cuda::par_nosync (see test_nccl_gpu.cu).

#include <doctest/doctest.h>

#include <thrust/system/cpp/execution_policy.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gradsync/backend/nccl/kernels.cuh"
#include "gradsync/core/local_reduce.hpp"

namespace {

template <class T>
T value(int i, int salt) {
  // Mixed signs and magnitudes; halves get values that round.
  const int v = ((i * 37 + salt * 11) % 23) - 11;
  if constexpr (gradsync::detail::is_half_storage_v<T>) {
    return T(static_cast<float>(v) * 0.3f + 0.01f * static_cast<float>(salt));
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(v) * static_cast<T>(0.3) + static_cast<T>(salt) / 100;
  } else {
    return static_cast<T>(v == 0 ? 1 : v);
  }
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace

TEST_CASE_TEMPLATE("Thrust reduce and finish kernels match core's, bit for bit", T, float, double, std::int32_t,
                   std::int64_t, gradsync::bfloat16, gradsync::float16) {
  using namespace gradsync;
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
    for (OpKind op : {OpKind::sum, OpKind::avg, OpKind::min, OpKind::max, OpKind::prod}) {
      CAPTURE(n);
      CAPTURE(static_cast<int>(op));
      std::vector<T> dst(n), src(n);
      for (std::size_t i = 0; i < n; ++i) {
        dst[i] = value<T>(static_cast<int>(i), 1);
        src[i] = value<T>(static_cast<int>(i), 2);
      }
      std::vector<T> want = dst, got = dst;
      detail::reduce_into_erased(data_type_v<T>, op, want.data(), src.data(), n);
      detail::nccl::reduce_erased(thrust::cpp::par, data_type_v<T>, op, got.data(), src.data(), n);
      CHECK(same_bits(got, want));
      for (int world : {1, 3, 8}) {
        std::vector<T> w = want, g = want;
        detail::finish_erased(data_type_v<T>, op, w.data(), n, world);
        detail::nccl::finish_erased(thrust::cpp::par, data_type_v<T>, op, g.data(), n, world);
        CHECK(same_bits(g, w));
      }
    }
  }
}
