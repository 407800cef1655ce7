#pragma once
/// \file gradsync's element types and ops in NCCL's terms.

#include <nccl.h>

#include <cstdint>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/float16.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/visit.hpp"

namespace gradsync::detail::nccl {

constexpr ncclDataType_t datatype_of(float) noexcept { return ncclFloat32; }
constexpr ncclDataType_t datatype_of(double) noexcept { return ncclFloat64; }
constexpr ncclDataType_t datatype_of(std::int32_t) noexcept { return ncclInt32; }
constexpr ncclDataType_t datatype_of(std::int64_t) noexcept { return ncclInt64; }
constexpr ncclDataType_t datatype_of(bfloat16) noexcept { return ncclBfloat16; }
constexpr ncclDataType_t datatype_of(float16) noexcept { return ncclFloat16; }

constexpr ncclDataType_t datatype(DataType t) noexcept {
  return visit(t, [](auto x) { return datatype_of(x); });
}

constexpr bool is_integer(DataType t) noexcept { return t == DataType::int32 || t == DataType::int64; }

constexpr ncclRedOp_t redop_of(Sum) noexcept { return ncclSum; }
constexpr ncclRedOp_t redop_of(Avg) noexcept { return ncclAvg; }
constexpr ncclRedOp_t redop_of(Min) noexcept { return ncclMin; }
constexpr ncclRedOp_t redop_of(Max) noexcept { return ncclMax; }
constexpr ncclRedOp_t redop_of(Prod) noexcept { return ncclProd; }

/// Avg maps to ncclAvg for floating types. Integers sum and then divide with
/// gradsync's finish kernel, so they truncate toward zero as on the host.
constexpr ncclRedOp_t redop(OpKind op, DataType t) noexcept {
  if (op == OpKind::avg && is_integer(t)) return ncclSum;
  return visit(op, [](auto o) { return redop_of(o); });
}

/// Whether Native needs gradsync's finish kernel after NCCL's collective.
constexpr bool needs_finish(OpKind op, DataType t) noexcept { return op == OpKind::avg && is_integer(t); }

}  // namespace gradsync::detail::nccl
