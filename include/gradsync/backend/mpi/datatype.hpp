#pragma once
/// \file gradsync element types and ops as MPI datatypes and MPI_Ops.

#include <mpi.h>

#include <cstdint>
#include <type_traits>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/float16.hpp"
#include "gradsync/core/local_reduce.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/visit.hpp"

namespace gradsync::detail::mpi {

inline MPI_Datatype datatype_of(float) noexcept { return MPI_FLOAT; }
inline MPI_Datatype datatype_of(double) noexcept { return MPI_DOUBLE; }
inline MPI_Datatype datatype_of(std::int32_t) noexcept { return MPI_INT32_T; }
inline MPI_Datatype datatype_of(std::int64_t) noexcept { return MPI_INT64_T; }
// MPI has no 16-bit floats: they travel as 16-bit words and are reduced by
// the user ops below.
inline MPI_Datatype datatype_of(bfloat16) noexcept { return MPI_UINT16_T; }
inline MPI_Datatype datatype_of(float16) noexcept { return MPI_UINT16_T; }

inline MPI_Datatype datatype(DataType t) noexcept {
  return visit(t, [](auto x) { return datatype_of(x); });
}

inline MPI_Op builtin_op(Sum) noexcept { return MPI_SUM; }
inline MPI_Op builtin_op(Avg) noexcept { return MPI_SUM; }  // finish divides
inline MPI_Op builtin_op(Min) noexcept { return MPI_MIN; }
inline MPI_Op builtin_op(Max) noexcept { return MPI_MAX; }
inline MPI_Op builtin_op(Prod) noexcept { return MPI_PROD; }

template <class T, class Op>
void user_op_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  // MPI's convention is inout = in op inout; the order changes no value
  // (Min and Max give the quiet NaN for any NaN, and order signed zeros).
  reduce_into_kind(Op::kind, static_cast<T*>(inout), static_cast<const T*>(in), static_cast<std::size_t>(*len));
}

/// The user op reducing T with Op, created on first use (Avg shares Sum's).
template <class T, class Op>
MPI_Op user_op() {
  if constexpr (std::is_same_v<Op, Avg>) {
    return user_op<T, Sum>();
  } else {
    static const MPI_Op o = [] {
      MPI_Op h{};
      MPI_Op_create(&user_op_fn<T, Op>, 1, &h);
      return h;
    }();
    return o;
  }
}

/// Built-in ops, except where MPI's would differ from the other algorithms':
/// bfloat16 and float16, which MPI does not know (a user op widens to float
/// per step exactly as the other algorithms do), and Min and Max of floats
/// (MPI_MIN and MPI_MAX keep or drop a NaN by the order they meet it in).
inline MPI_Op op(OpKind k, DataType t) {
  return visit(k, [&]<class Op>(Op o) {
    if (t == DataType::bfloat16) return user_op<bfloat16, Op>();
    if (t == DataType::float16) return user_op<float16, Op>();
    if constexpr (std::is_same_v<Op, Min> || std::is_same_v<Op, Max>) {
      if (t == DataType::float32) return user_op<float, Op>();
      if (t == DataType::float64) return user_op<double, Op>();
    }
    return builtin_op(o);
  });
}

}  // namespace gradsync::detail::mpi
