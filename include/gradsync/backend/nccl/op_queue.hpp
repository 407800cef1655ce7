#pragma once
/// \file The host-side order of the Nccl endpoint's point-to-point work.
///
/// CUDA-free on purpose: the ordering rules below are what make NCCL's
/// tagless send/recv correct under gradsync's algorithms, and a host test
/// (test/nccl/test_nccl_matching.cpp) runs every algorithm through this very
/// class to check them without a GPU.
///
/// NCCL matches the k-th ncclSend from A to B with the k-th ncclRecv at B
/// from A; tags do not exist. gradsync's algorithms post operations with
/// tags and consume completions through wait_any. The queue makes wait_any
/// FIFO: when no flushed operation is left to report, everything posted
/// since the last flush is issued as one batch (one ncclGroupStart/End) and
/// its tokens are then reported in posting order. Because completion order
/// is then a function of posting order alone, and the algorithms decide
/// what to post next only from completions, every rank's sequence of posts
/// is a fixed function of the call. Order matching is correct exactly when,
/// for every ordered pair (A, B), A's sends to B and B's receives from A
/// come out with the same tags in the same order. The matching test checks
/// that invariant (and that no batch waits on a later batch) per algorithm.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "gradsync/core/call_info.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/rank_names.hpp"
#include "gradsync/core/types.hpp"

namespace gradsync::detail::nccl {

/// One posted point-to-point operation, not yet issued.
struct PostedOp {
  enum Kind : std::uint8_t { send, recv, recv_reduce };
  Kind kind = send;
  const void* src = nullptr;  ///< send
  void* dst = nullptr;        ///< recv, recv_reduce
  std::size_t count = 0;
  DataType type = DataType::float32;
  int peer = 0;
  std::uint32_t tag = 0;
  std::uint32_t token = 0;
  OpKind op = OpKind::sum;
};

/// Posted operations and FIFO completions.
class OpQueue {
 public:
  void post(const PostedOp& op) { posted_.push_back(op); }

  /// Operations posted since the last flush.
  std::span<const PostedOp> posted() const noexcept { return posted_; }

  /// Issues the posted batch through `issue(span<const PostedOp>)` (which
  /// enqueues it on the stream) and marks its tokens complete, in order.
  template <class Issue>
  void flush(Issue&& issue) {
    if (posted_.empty()) return;
    issue(std::span<const PostedOp>(posted_));
    for (const PostedOp& op : posted_) completed_.push_back(op.token);
    posted_.clear();
  }

  /// The oldest completed token, flushing first when none is left. `names`
  /// names `rank` if there is nothing to wait for (an algorithm's bug).
  template <class Issue>
  std::uint32_t next(const CallInfo& call, const RankNames& names, int rank, Issue&& issue) {
    if (completed_.empty()) {
      if (posted_.empty()) {
        throw Error("gradsync: " + names.who(rank) + ": wait_any with nothing in flight in " +
                    describe(call));
      }
      flush(issue);
    }
    const std::uint32_t token = completed_.front();
    completed_.pop_front();
    return token;
  }

  std::size_t pending() const noexcept { return posted_.size() + completed_.size(); }

  void clear() noexcept {
    posted_.clear();
    completed_.clear();
  }

 private:
  std::vector<PostedOp> posted_;
  std::deque<std::uint32_t> completed_;
};

}  // namespace gradsync::detail::nccl
