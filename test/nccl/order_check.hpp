#pragma once
// Checks recorded NCCL point-to-point batches for order-matching safety.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/backend/nccl/op_queue.hpp"
#include "gradsync/core/local_reduce.hpp"

namespace gradsync::detail::nccl {

struct IssuedOp {
  PostedOp op;
  std::size_t batch = 0;
};

/// What one rank issued, batch by batch, plus any hazard found on the way.
struct RankLog {
  std::vector<IssuedOp> ops;
  std::size_t batches = 0;
  std::string hazard;

  void issue(std::span<const PostedOp> batch) {
    for (const PostedOp& op : batch) ops.push_back({op, batches});
    ++batches;
  }

  /// A local op runs on the stream at once, ahead of posted-but-unissued
  /// operations: it must not write what they read or touch what they write.
  void check_local(std::span<const PostedOp> posted, const void* dst, const void* src, std::size_t n, DataType t,
                   const char* what) {
    const std::size_t bytes = n * size_of(t);
    auto overlap = [&](const void* a, std::size_t an, const void* b, std::size_t bn) {
      const auto* pa = static_cast<const std::byte*>(a);
      const auto* pb = static_cast<const std::byte*>(b);
      return a && b && an && bn && pa < pb + bn && pb < pa + an;
    };
    for (const PostedOp& op : posted) {
      const std::size_t ob = op.count * size_of(op.type);
      const bool bad = op.kind == PostedOp::send ? overlap(dst, bytes, op.src, ob)
                                                 : overlap(dst, bytes, op.dst, ob) || overlap(src, bytes, op.dst, ob);
      if (bad && hazard.empty()) hazard = std::string(what) + " overlaps a posted, unissued operation with peer " +
                                          std::to_string(op.peer) + " tag " + std::to_string(op.tag);
    }
  }
};

/// Empty if every pair's sends and receives agree in order, tag, count and
/// type, and stream-ordered execution of the batches completes; otherwise
/// the first problem, in words.
inline std::string check_order(const std::vector<RankLog>& logs) {
  const int p = static_cast<int>(logs.size());
  for (int r = 0; r < p; ++r)
    if (!logs[static_cast<std::size_t>(r)].hazard.empty())
      return "rank " + std::to_string(r) + ": " + logs[static_cast<std::size_t>(r)].hazard;
  // Per ordered pair (from, to): indices into the sender's and receiver's logs.
  std::map<std::pair<int, int>, std::vector<std::size_t>> sends, recvs;
  for (int r = 0; r < p; ++r) {
    const auto& ops = logs[static_cast<std::size_t>(r)].ops;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const PostedOp& op = ops[i].op;
      if (op.peer == r) return "rank " + std::to_string(r) + " sends to or receives from itself";
      if (op.kind == PostedOp::send) {
        sends[{r, op.peer}].push_back(i);
      } else {
        recvs[{op.peer, r}].push_back(i);
      }
    }
  }
  // partner[r][i]: (rank, index) of the op matched with rank r's i-th op.
  std::vector<std::vector<std::pair<int, std::size_t>>> partner(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) partner[static_cast<std::size_t>(r)].resize(logs[static_cast<std::size_t>(r)].ops.size());
  auto pair_name = [](int a, int b) { return std::to_string(a) + "->" + std::to_string(b); };
  for (auto& [key, s] : sends) {
    const auto& rv = recvs[key];
    if (s.size() != rv.size()) {
      return "pair " + pair_name(key.first, key.second) + ": " + std::to_string(s.size()) + " sends but " +
             std::to_string(rv.size()) + " receives";
    }
    for (std::size_t k = 0; k < s.size(); ++k) {
      const PostedOp& a = logs[static_cast<std::size_t>(key.first)].ops[s[k]].op;
      const PostedOp& b = logs[static_cast<std::size_t>(key.second)].ops[rv[k]].op;
      if (a.tag != b.tag || a.count != b.count || a.type != b.type) {
        return "pair " + pair_name(key.first, key.second) + ", message " + std::to_string(k) + ": sent tag " +
               std::to_string(a.tag) + " (" + std::to_string(a.count) + " elements) but the receive posted in that " +
               "place has tag " + std::to_string(b.tag) + " (" + std::to_string(b.count) + " elements)";
      }
      partner[static_cast<std::size_t>(key.first)][s[k]] = {key.second, rv[k]};
      partner[static_cast<std::size_t>(key.second)][rv[k]] = {key.first, s[k]};
    }
  }
  for (auto& [key, rv] : recvs)
    if (!sends.count(key) && !rv.empty())
      return "pair " + pair_name(key.first, key.second) + ": receives posted but nothing sent";
  // Rendezvous execution: a rank's current batch completes once each of its
  // ops' partners sits in the partner rank's current batch.
  std::vector<std::size_t> current(static_cast<std::size_t>(p), 0);
  std::vector<std::size_t> first(static_cast<std::size_t>(p), 0);  // first op of the current batch
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const auto& log = logs[static_cast<std::size_t>(r)];
      auto& b = current[static_cast<std::size_t>(r)];
      auto& f = first[static_cast<std::size_t>(r)];
      if (b >= log.batches) continue;
      bool ready = true;
      std::size_t i = f;
      for (; i < log.ops.size() && log.ops[i].batch == b; ++i) {
        const auto [q, j] = partner[static_cast<std::size_t>(r)][i];
        if (logs[static_cast<std::size_t>(q)].ops[j].batch > current[static_cast<std::size_t>(q)]) ready = false;
      }
      if (ready) {
        ++b;
        f = i;
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r)
    if (current[static_cast<std::size_t>(r)] < logs[static_cast<std::size_t>(r)].batches)
      return "rank " + std::to_string(r) + " is stuck in batch " + std::to_string(current[static_cast<std::size_t>(r)]) +
             ": a receive or send in it is matched only by a later batch of its peer";
  return {};
}

}  // namespace gradsync::detail::nccl
