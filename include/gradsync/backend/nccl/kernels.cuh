#pragma once
/// \file The Nccl backend's local reduce and finish kernels, written once
/// against Thrust's execution policies.
///
/// With `thrust::cuda::par_nosync.on(stream)` they are CUDA kernels ordered
/// on a stream; with `thrust::cpp::par` the very same functors run on the
/// host, which is how test/nccl/test_nccl_kernels_host.cpp checks them
/// against core's reduce_into without a GPU. bfloat16 and float16 are
/// 2-byte structs whose float conversions are constexpr, so nvcc's
/// --expt-relaxed-constexpr makes Op::apply callable on the device.

#include <thrust/transform.h>

#include <cstddef>
#include <cstdint>

#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"

#if defined(__CUDACC__)
#define GRADSYNC_HOST_DEVICE __host__ __device__
#else
#define GRADSYNC_HOST_DEVICE
#endif

namespace gradsync::detail::nccl {

/// a = op(a, b), element-wise, as core's reduce_into does it.
template <class Op>
struct CombineFn {
  template <class T>
  GRADSYNC_HOST_DEVICE T operator()(T a, T b) const {
    return Op::apply(a, b);
  }
};

/// Avg's division by the world size.
struct DivideFn {
  int world = 1;
  template <class T>
  GRADSYNC_HOST_DEVICE T operator()(T x) const {
    return Avg::finish(x, world);
  }
};

/// dst[i] = op(dst[i], src[i]) on `policy`.
template <class Policy, class T>
void reduce_typed(const Policy& policy, OpKind op, T* dst, const T* src, std::size_t n) {
  const auto len = static_cast<std::ptrdiff_t>(n);
  switch (op) {
    case OpKind::sum:
    case OpKind::avg: thrust::transform(policy, dst, dst + len, src, dst, CombineFn<Sum>{}); return;
    case OpKind::min: thrust::transform(policy, dst, dst + len, src, dst, CombineFn<Min>{}); return;
    case OpKind::max: thrust::transform(policy, dst, dst + len, src, dst, CombineFn<Max>{}); return;
    case OpKind::prod: thrust::transform(policy, dst, dst + len, src, dst, CombineFn<Prod>{}); return;
  }
}

/// dst = op(dst, src) for n elements of `type`, on `policy`.
template <class Policy>
void reduce_erased(const Policy& policy, DataType type, OpKind op, void* dst, const void* src, std::size_t n) {
  if (n == 0) return;
  switch (type) {
    case DataType::float32: return reduce_typed(policy, op, static_cast<float*>(dst), static_cast<const float*>(src), n);
    case DataType::float64:
      return reduce_typed(policy, op, static_cast<double*>(dst), static_cast<const double*>(src), n);
    case DataType::int32:
      return reduce_typed(policy, op, static_cast<std::int32_t*>(dst), static_cast<const std::int32_t*>(src), n);
    case DataType::int64:
      return reduce_typed(policy, op, static_cast<std::int64_t*>(dst), static_cast<const std::int64_t*>(src), n);
    case DataType::bfloat16:
      return reduce_typed(policy, op, static_cast<bfloat16*>(dst), static_cast<const bfloat16*>(src), n);
    case DataType::float16:
      return reduce_typed(policy, op, static_cast<float16*>(dst), static_cast<const float16*>(src), n);
  }
}

template <class Policy, class T>
void finish_typed(const Policy& policy, T* data, std::size_t n, int world) {
  thrust::transform(policy, data, data + static_cast<std::ptrdiff_t>(n), data, DivideFn{world});
}

/// Op::finish (Avg's division) for n elements of `type`; nothing for other ops.
template <class Policy>
void finish_erased(const Policy& policy, DataType type, OpKind op, void* data, std::size_t n, int world) {
  if (op != OpKind::avg || n == 0) return;
  switch (type) {
    case DataType::float32: return finish_typed(policy, static_cast<float*>(data), n, world);
    case DataType::float64: return finish_typed(policy, static_cast<double*>(data), n, world);
    case DataType::int32: return finish_typed(policy, static_cast<std::int32_t*>(data), n, world);
    case DataType::int64: return finish_typed(policy, static_cast<std::int64_t*>(data), n, world);
    case DataType::bfloat16: return finish_typed(policy, static_cast<bfloat16*>(data), n, world);
    case DataType::float16: return finish_typed(policy, static_cast<float16*>(data), n, world);
  }
}

}  // namespace gradsync::detail::nccl
