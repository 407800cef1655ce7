// NCCL matches point-to-point by issue order per pair of ranks, not by tag.
// This host test runs gradsync's own algorithms through the Nccl endpoint's
// OpQueue (the same FIFO batching it uses on a GPU) with a recording
// transport, then checks, per world size, count, root and option:
//  - order: A's k-th send to B carries the tag and count of B's k-th receive
//    from A, for every ordered pair;
//  - progress: executing each rank's batches in stream order, with a send
//    completing only when its receive is in the peer's current batch, every
//    batch completes (no batch waits on a later one);
//  - hazards: no local copy/reduce/finish (enqueued at once) touches memory
//    that a posted-but-not-yet-issued operation uses.
// It needs no GPU and no NCCL; it is what makes order matching trustworthy.

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/algorithm/recursive_halving_doubling.hpp"
#include "gradsync/algorithm/ring.hpp"
#include "gradsync/algorithm/tree.hpp"
#include "gradsync/backend/nccl/op_queue.hpp"
#include "order_check.hpp"
#include "gradsync/collective/all_gather.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/collective/reduce_scatter.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/cost_model.hpp"

namespace {

using gradsync::detail::nccl::IssuedOp;
using gradsync::detail::nccl::OpQueue;
using gradsync::detail::nccl::PostedOp;
using gradsync::detail::nccl::RankLog;

/// Records what the Nccl endpoint would issue, moving no data.
class RecordingEndpoint {
 public:
  RecordingEndpoint(int rank, int size, RankLog* log) : rank_(rank), size_(size), log_(log) {}
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  void post_send(const void* data, std::size_t n, gradsync::DataType t, int peer, std::uint32_t tag,
                 std::uint32_t token, const gradsync::detail::CallInfo&) {
    queue_.post({PostedOp::send, data, nullptr, n, t, peer, tag, token, gradsync::OpKind::sum});
  }
  void post_recv(void* data, std::size_t n, gradsync::DataType t, int peer, std::uint32_t tag, std::uint32_t token,
                 const gradsync::detail::CallInfo&, gradsync::OpKind op, bool reduce) {
    queue_.post({reduce ? PostedOp::recv_reduce : PostedOp::recv, nullptr, data, n, t, peer, tag, token, op});
  }
  std::uint32_t wait_any(const gradsync::detail::CallInfo& call, std::chrono::nanoseconds) {
    return queue_.next(call, gradsync::detail::RankNames::world(), rank_,
                       [&](std::span<const PostedOp> batch) { log_->issue(batch); });
  }
  std::size_t pending() const noexcept { return queue_.pending(); }
  void barrier(const gradsync::detail::CallInfo&, std::chrono::nanoseconds) {}
  void local_copy(void* dst, const void* src, std::size_t n, gradsync::DataType t) {
    log_->check_local(queue_.posted(), dst, src, n, t, "local_copy");
  }
  void local_reduce(void* dst, const void* src, std::size_t n, gradsync::DataType t, gradsync::OpKind) {
    log_->check_local(queue_.posted(), dst, src, n, t, "local_reduce");
  }
  void local_finish(void* data, std::size_t n, gradsync::DataType t, gradsync::OpKind) {
    log_->check_local(queue_.posted(), data, nullptr, n, t, "local_finish");
  }
  void fail(const gradsync::detail::CallInfo&, std::string_view, gradsync::detail::FailureKind) noexcept { queue_.clear(); }

 private:
  int rank_;
  int size_;
  RankLog* log_;
  OpQueue queue_;
};

struct Recording {
  using Endpoint = RecordingEndpoint;
  static constexpr gradsync::CostModel cost_model{};
};

enum class Coll { all_reduce, reduce_scatter, all_gather, broadcast };

const char* coll_name(Coll c) {
  switch (c) {
    case Coll::all_reduce: return "all_reduce";
    case Coll::reduce_scatter: return "reduce_scatter";
    case Coll::all_gather: return "all_gather";
    case Coll::broadcast: return "broadcast";
  }
  return "?";
}

/// Runs one collective on every rank (one after another: nothing blocks)
/// and returns what each rank issued.
template <class Algo>
std::vector<RankLog> record(Coll coll, int p, std::size_t count, int root, gradsync::Options opt) {
  std::vector<RankLog> logs(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    gradsync::Communicator<Recording> comm{RecordingEndpoint(r, p, &logs[static_cast<std::size_t>(r)])};
    const std::size_t total = coll == Coll::all_reduce || coll == Coll::broadcast ? count : count * static_cast<std::size_t>(p);
    std::vector<float> in(total), out(total);
    switch (coll) {
      case Coll::all_reduce:
        gradsync::AllReduce<Algo>{opt}(comm, std::span<const float>(in), std::span<float>(out));
        break;
      case Coll::reduce_scatter:
        gradsync::ReduceScatter<Algo>{opt}(comm, std::span<const float>(in), std::span<float>(out.data(), count));
        break;
      case Coll::all_gather:
        gradsync::AllGather<Algo>{opt}(comm, std::span<const float>(in.data(), count), std::span<float>(out));
        break;
      case Coll::broadcast: gradsync::Broadcast<Algo>{opt}(comm, std::span<float>(out), root); break;
    }
  }
  return logs;
}

/// The order checker's verdict on one collective, empty when all is well.
template <class Algo>
std::string run_one(Coll coll, int p, std::size_t count, int root, gradsync::Options opt) {
  return gradsync::detail::nccl::check_order(record<Algo>(coll, p, count, root, opt));
}

/// Every configuration must pass the order check (the Nccl endpoint runs
/// them all); returns those that do not.
template <class Algo>
std::vector<std::string> sweep(Coll coll) {
  std::vector<std::string> wrong;
  for (int p : {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17}) {
    for (std::size_t count : {0, 1, 2, 5, 13, 97, 1000}) {
      for (bool det : {false, true}) {
        // 4- and 64-byte chunks: many pipelined pieces in flight at once.
        for (std::size_t chunk : {0, 4, 64}) {
          const int roots = coll == Coll::broadcast ? p : 1;
          for (int root = 0; root < roots; ++root) {
            const std::string why = run_one<Algo>(coll, p, count, root, {.deterministic = det, .chunk_bytes = chunk});
            if (why.empty()) continue;
            std::ostringstream s;
            s << Algo::name << " " << coll_name(coll) << " p=" << p << " count=" << count << " root=" << root
              << (det ? " deterministic" : "") << " chunk=" << chunk << ": " << why;
            wrong.push_back(s.str());
          }
        }
      }
    }
  }
  return wrong;
}

template <class Algo>
void expect_order_safe(Coll coll) {
  const auto wrong = sweep<Algo>(coll);
  for (std::size_t i = 0; i < wrong.size() && i < 5; ++i) MESSAGE(wrong[i]);
  CHECK_MESSAGE(wrong.empty(), wrong.size(), " configurations of ", std::string(Algo::name), " ", std::string(coll_name(coll)),
                " are not order-safe");
}

}  // namespace

TEST_CASE_TEMPLATE("p2p issue order matches across ranks", Algo, gradsync::Ring, gradsync::Tree,
                   gradsync::RecursiveHalvingDoubling) {
  for (Coll c : {Coll::all_reduce, Coll::reduce_scatter, Coll::all_gather, Coll::broadcast}) {
    expect_order_safe<Algo>(c);
  }
}

TEST_CASE("Tree's double-tree AllReduce is order-safe at every size and chunking") {
  // Sizes past full trees (15..17, 31..33), counts that leave one half empty
  // or odd, and chunks down to one element, so hundreds of pieces of both
  // trees go up and down at once.
  std::size_t checked = 0;
  for (int p : {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16, 17, 31, 32, 33}) {
    for (std::size_t count : {0, 1, 2, 3, 7, 13, 31, 97, 1000, 1021}) {
      for (std::size_t chunk : {0, 4, 8, 12, 64, 1024}) {
        CAPTURE(p);
        CAPTURE(count);
        CAPTURE(chunk);
        const auto logs = record<gradsync::Tree>(Coll::all_reduce, p, count, -1, {.chunk_bytes = chunk});
        CHECK(gradsync::detail::nccl::check_order(logs) == "");
        // Per chunk, each of the two trees' p - 1 edges carries one message up
        // and one down, each a send and a receive: nothing is left out.
        std::size_t ops = 0;
        for (const RankLog& log : logs) ops += log.ops.size();
        const std::size_t chunks = gradsync::detail::pieces_for(
            (count + 1) / 2, gradsync::detail::chunk_bytes({.chunk_bytes = chunk}) / sizeof(float));
        CHECK(ops == (p > 1 ? 2 * chunks * 4 * static_cast<std::size_t>(p - 1) : 0));
        ++checked;
      }
    }
  }
  CHECK(checked > 1000);
}

TEST_CASE("the checker catches two messages of a real Tree AllReduce swapped") {
  // Every pair of same-direction messages between two ranks with different
  // tags, swapped in one rank's log, must be caught.
  for (int p : {2, 3, 5, 8}) {
    const auto logs = record<gradsync::Tree>(Coll::all_reduce, p, 97, -1, {.chunk_bytes = 64});
    REQUIRE(gradsync::detail::nccl::check_order(logs) == "");
    std::size_t swaps = 0;
    for (std::size_t r = 0; r < logs.size(); ++r) {
      const auto& ops = logs[r].ops;
      for (std::size_t i = 0; i < ops.size(); ++i) {
        for (std::size_t j = i + 1; j < ops.size(); ++j) {
          const PostedOp& a = ops[i].op;
          const PostedOp& b = ops[j].op;
          if (a.peer != b.peer || (a.kind == PostedOp::send) != (b.kind == PostedOp::send) || a.tag == b.tag) continue;
          auto broken = logs;
          std::swap(broken[r].ops[i].op, broken[r].ops[j].op);
          CAPTURE(p);
          CAPTURE(r);
          CHECK(gradsync::detail::nccl::check_order(broken) != "");
          ++swaps;
        }
      }
    }
    CHECK(swaps > 0);
  }
}

TEST_CASE("the checker catches a swapped pair") {
  // Rank 0 sends tags 1 then 2 to rank 1, which receives 2 then 1.
  std::vector<RankLog> logs(2);
  float a[2], b[2];
  const PostedOp s1{PostedOp::send, a, nullptr, 1, gradsync::DataType::float32, 1, 1, 0, gradsync::OpKind::sum};
  const PostedOp s2{PostedOp::send, a + 1, nullptr, 1, gradsync::DataType::float32, 1, 2, 0, gradsync::OpKind::sum};
  const PostedOp r2{PostedOp::recv, nullptr, b, 1, gradsync::DataType::float32, 0, 2, 1, gradsync::OpKind::sum};
  const PostedOp r1{PostedOp::recv, nullptr, b + 1, 1, gradsync::DataType::float32, 0, 1, 2, gradsync::OpKind::sum};
  const PostedOp batch0[] = {s1, s2};
  const PostedOp batch1[] = {r2, r1};
  logs[0].issue(batch0);
  logs[1].issue(batch1);
  CHECK(gradsync::detail::nccl::check_order(logs).find("tag") != std::string::npos);
}

TEST_CASE("the checker catches a batch that waits on a later one") {
  // Each rank receives first, alone in a batch, and sends only afterwards.
  std::vector<RankLog> logs(2);
  float a[1], b[1];
  for (int r = 0; r < 2; ++r) {
    const PostedOp rv{PostedOp::recv, nullptr, b, 1, gradsync::DataType::float32, 1 - r, 0, 1, gradsync::OpKind::sum};
    const PostedOp sd{PostedOp::send, a, nullptr, 1, gradsync::DataType::float32, 1 - r, 0, 0, gradsync::OpKind::sum};
    logs[static_cast<std::size_t>(r)].issue(std::span<const PostedOp>(&rv, 1));
    logs[static_cast<std::size_t>(r)].issue(std::span<const PostedOp>(&sd, 1));
  }
  CHECK(gradsync::detail::nccl::check_order(logs).find("stuck") != std::string::npos);
}
