#pragma once
/// \file What both trainers do for a model that computes in bfloat16
/// (compute_type): round the master into the bfloat16 copy it sees, add its
/// bfloat16 gradient into the master-type one, and refuse it buffers.

#include <cstddef>
#include <span>
#include <string>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/train/common/model.hpp"

namespace gradsync::detail {

/// copy[i] = master[i] rounded to bfloat16.
template <class T>
void round_into(std::span<const T> master, std::span<bfloat16> copy) noexcept {
  for (std::size_t i = 0; i < master.size(); ++i) copy[i] = bfloat16(static_cast<float>(master[i]));
}

/// grads[i] += bf16[i], widened: one rounding per rank, the model's.
template <class T>
void add_widened(std::span<T> grads, std::span<const bfloat16> bf16) noexcept {
  for (std::size_t i = 0; i < grads.size(); ++i) grads[i] += static_cast<T>(static_cast<float>(bf16[i]));
}

/// A bfloat16 model's views have no buffers: buffers are kept in the
/// master type and lent in place. `where` names trainer and rank; every
/// rank has the same units, so every rank throws alike.
inline void refuse_buffers_of_bf16_model(const std::string& where, std::span<const UnitSpec> units,
                                        DataType master) {
  for (const UnitSpec& u : units) {
    if (u.buffers.empty()) continue;
    throw InvalidArgument(where + ": the model computes in bfloat16 (its compute_type) and declares buffers (unit '" +
                          u.name + "', '" + u.buffers.front().name + "'), which are kept in " +
                          std::string(name(master)) + " and lent in place: a bfloat16 model with buffers is not "
                          "supported");
  }
}

}  // namespace gradsync::detail
