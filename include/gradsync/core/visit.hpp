#pragma once
/// \file The one place a run-time DataType or OpKind becomes a type.
///
/// `visit(type, f)` calls `f(T{})` with the element type of `type`;
/// `visit(op, f)` calls `f(Op{})` with the op type of `op`. Everything that
/// needs a type for a value (local reduce kernels, MPI and NCCL handles, the
/// Native path's typed pointers, the benchmarks) goes through these two, so a
/// new type or op is added here and nowhere else.

#include <cstdint>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/float16.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync {

/// Calls f(T{}) with T the element type `t` names, and returns what f returns
/// (the same type for every T).
template <class F>
constexpr decltype(auto) visit(DataType t, F&& f) {
  switch (t) {
    case DataType::float64: return f(double{});
    case DataType::int32: return f(std::int32_t{});
    case DataType::int64: return f(std::int64_t{});
    case DataType::bfloat16: return f(bfloat16{});
    case DataType::float16: return f(float16{});
    // Every enumerator is named (-Wswitch checks it); the last one leaves the
    // switch so that f's result is returned on every path.
    case DataType::float32: break;
  }
  return f(float{});
}

/// Calls f(Op{}) with Op the op type `k` names (Sum, Avg, Min, Max, Prod),
/// and returns what f returns.
template <class F>
constexpr decltype(auto) visit(OpKind k, F&& f) {
  switch (k) {
    case OpKind::avg: return f(Avg{});
    case OpKind::min: return f(Min{});
    case OpKind::max: return f(Max{});
    case OpKind::prod: return f(Prod{});
    case OpKind::sum: break;
  }
  return f(Sum{});
}

}  // namespace gradsync
