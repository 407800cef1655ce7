#pragma once
/// \file PrimitiveCall: what the four primitives share between their typed
/// arguments and launch.

#include <cstddef>
#include <string>
#include <string_view>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/launch.hpp"
#include "gradsync/core/buffer.hpp"
#include "gradsync/core/collective.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/validate.hpp"

namespace gradsync::detail {

/// One call of primitive C with algorithm Algo on `comm`: the checks more
/// than one primitive makes, and the launch. The primitives hold their
/// options themselves, as plain members, so that they stay aggregates
/// (`AllReduce<Ring>{{.deterministic = true}}`, `AllReduce{opts}`); errors
/// name the primitive through `name(C)`.
template <Collective C, class Algo, class B>
struct PrimitiveCall {
  Communicator<B>& comm;
  const Options& options;

  /// Throws InvalidArgument naming the primitive, the rank and `why`.
  [[noreturn]] void reject(const std::string& why) const { invalid(name(C), who(comm), why); }

  /// Checks that the buffer named `whole` holds comm.size() blocks of the
  /// size of the one named `block` (ReduceScatter's in, AllGather's out).
  void expect_blocks(std::string_view whole_name, std::size_t whole, std::string_view block_name,
                     std::size_t block) const {
    const auto p = static_cast<std::size_t>(comm.size());
    if (whole == block * p) return;
    reject("expected " + std::string(whole_name) + ".size() == " + std::string(block_name) +
           ".size() * comm.size() = " + std::to_string(block) + " * " + std::to_string(p) + " = " +
           std::to_string(block * p) + ", got " + std::string(whole_name) + ".size() = " + std::to_string(whole));
  }

  /// Runs the checked call; `count` is the size every rank passes.
  void run(ConstBuffer in, Buffer out, OpKind op, int root, std::size_t count) const {
    launch<C, Algo>(comm, {in, out, op, root, &options}, count);
  }
};

}  // namespace gradsync::detail
