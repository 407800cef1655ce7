#pragma once
/// \file gradsync element types and ops as MPI datatypes and MPI_Ops.

#include <mpi.h>

#include <array>
#include <cstdint>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/local_reduce.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync::detail::mpi {

inline MPI_Datatype datatype(DataType t) noexcept {
  switch (t) {
    case DataType::float32: return MPI_FLOAT;
    case DataType::float64: return MPI_DOUBLE;
    case DataType::int32: return MPI_INT32_T;
    case DataType::int64: return MPI_INT64_T;
    case DataType::bfloat16:
    case DataType::float16: return MPI_UINT16_T;  // reduced by the user ops below
  }
  return MPI_BYTE;
}

template <class T, OpKind K>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  // MPI's convention is inout = in op inout; op order does not change the bits.
  reduce_into_kind(K, static_cast<T*>(inout), static_cast<const T*>(in), static_cast<std::size_t>(*len));
}

template <class T>
const std::array<MPI_Op, 4>& half_ops() {
  static const std::array<MPI_Op, 4> ops = [] {
    std::array<MPI_Op, 4> o{};
    MPI_Op_create(&half_op<T, OpKind::sum>, 1, &o[0]);
    MPI_Op_create(&half_op<T, OpKind::min>, 1, &o[1]);
    MPI_Op_create(&half_op<T, OpKind::max>, 1, &o[2]);
    MPI_Op_create(&half_op<T, OpKind::prod>, 1, &o[3]);
    return o;
  }();
  return ops;
}

/// Built-in ops, except for bfloat16 and float16, which MPI does not know:
/// there a user op widens to float per step exactly as the other algorithms do.
inline MPI_Op op(OpKind k, DataType t) {
  if (t == DataType::bfloat16 || t == DataType::float16) {
    const auto& ops = t == DataType::bfloat16 ? half_ops<bfloat16>() : half_ops<float16>();
    switch (k) {
      case OpKind::sum:
      case OpKind::avg: return ops[0];
      case OpKind::min: return ops[1];
      case OpKind::max: return ops[2];
      case OpKind::prod: return ops[3];
    }
  }
  switch (k) {
    case OpKind::sum:
    case OpKind::avg: return MPI_SUM;
    case OpKind::min: return MPI_MIN;
    case OpKind::max: return MPI_MAX;
    case OpKind::prod: return MPI_PROD;
  }
  return MPI_SUM;
}

}  // namespace gradsync::detail::mpi
