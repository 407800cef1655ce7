#pragma once
/// \file Tree: the double binary tree, pipelined in chunks.
///
/// All-reduce splits the data in halves and runs each half up (reduce) and
/// down (broadcast) its own binary tree, chunk by chunk, so a large message
/// moves about 2·S per rank while a small one takes O(log N) steps. The
/// second tree is the first mirrored (even N) or shifted by one (odd N), so
/// most ranks that are interior in one tree are leaves in the other, and no
/// rank's links carry both halves' full traffic (Sanders, Speck & Träff 2009;
/// NCCL's trees). The other collectives use one tree: broadcast pipelines
/// chunks down from the root; all-gather gathers up then broadcasts down;
/// reduce-scatter reduces up in chunks then scatters each subtree its blocks.

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradsync/algorithm/algorithm.hpp"
#include "gradsync/algorithm/binary_tree.hpp"
#include "gradsync/algorithm/ordered_reduce_scatter.hpp"
#include "gradsync/algorithm/ring.hpp"
#include "gradsync/algorithm/tags.hpp"
#include "gradsync/core/buffer.hpp"
#include "gradsync/core/call_view.hpp"
#include "gradsync/core/options.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/partition.hpp"

namespace gradsync::detail {

/// One rank's place in a tree whose positions are ranks relabelled.
struct TreeNode {
  int parent = -1;
  std::array<int, 2> children{-1, -1};
  bool is_root() const noexcept { return parent < 0; }
};

/// Position of rank r in tree `which` of the double tree, and back.
inline int double_tree_pos(int r, int p, int which) noexcept {
  if (which == 0) return r;
  return p % 2 == 0 ? p - 1 - r : (r + 1) % p;
}
inline int double_tree_rank(int pos, int p, int which) noexcept {
  if (which == 0) return pos;
  return p % 2 == 0 ? p - 1 - pos : (pos + p - 1) % p;
}

template <class ToRank>
TreeNode tree_node(const BinaryTree& t, int pos, ToRank to_rank) {
  TreeNode n;
  const int up = t.parent(pos);
  n.parent = up < 0 ? -1 : to_rank(up);
  const auto c = t.children(pos);
  for (int i = 0; i < 2; ++i) n.children[static_cast<std::size_t>(i)] = c[static_cast<std::size_t>(i)] < 0 ? -1 : to_rank(c[static_cast<std::size_t>(i)]);
  return n;
}

/// Token layout for tree schedules: (unit << 2) | event.
enum TreeEvent : std::uint32_t { ev_send = 0, ev_child0 = 1, ev_child1 = 2, ev_parent = 3 };
inline std::uint32_t tree_token(std::size_t unit, TreeEvent e) noexcept {
  return static_cast<std::uint32_t>(unit << 2) | e;
}
inline std::uint32_t tree_tag(std::size_t unit, int down) noexcept {
  return static_cast<std::uint32_t>(unit << 1) | static_cast<std::uint32_t>(down);
}

/// Reduce up (and, with `broadcast_down`, back down) a set of trees, each
/// over its own range of x, in chunks. Unit u = chunk * trees + tree.
/// Without broadcast_down the caller scatters. Returns after every chunk has
/// gone up (and down).
///
/// Posting order, so that tagless order matching (Nccl) pairs every message:
/// between two ranks, messages go up one tree and down the other only where
/// one is a leaf child of the other in the first tree and the other's leaf
/// child in the second (no rank has children in both trees of the double
/// tree). So each rank posts, per peer, every up message before any down
/// message, each kind in chunk order:
///  - a leaf sends all its chunks up at once, and an interior rank receives
///    all its chunks from both children at once, before anything comes down
///    (receiving from the second child only after the first would let two
///    ranks that are each other's leaf child wait on each other's second
///    Nccl batch);
///  - a rank receives chunk k of a tree it is a leaf in only once chunk k of
///    the tree it has children in is final here (a rank with no children
///    anywhere receives at once). Posted any earlier, that receive would sit
///    in an Nccl batch waiting on the other tree's whole descent, and the
///    two descents would wait on each other.
/// Chunks still pipeline: both children's chunks overlap, and each chunk
/// starts down as soon as it is reduced.
template <class B>
void tree_reduce(CallView<B>& comm, Buffer x, OpKind op, std::span<const TreeNode> nodes,
                 std::span<const Range> ranges, std::size_t k_chunks, bool broadcast_down) {
  const std::size_t trees = nodes.size();
  const std::size_t units = trees * k_chunks;
  auto piece = [&](std::size_t u) {
    const Range c = sub(ranges[u % trees], k_chunks, u / trees);
    return x.subspan(c.begin, c.size());
  };
  // The tree this rank has children in, or `trees` if none.
  std::size_t inner = trees;
  for (std::size_t w = 0; w < trees; ++w)
    if (nodes[w].children[0] >= 0) inner = w;
  // Children still to arrive per unit: few units fit on the stack.
  std::array<std::uint8_t, 256> few{};
  std::vector<std::uint8_t> many(units > few.size() ? units : 0);
  std::uint8_t* left = units > few.size() ? many.data() : few.data();
  std::size_t open = units;  // units not yet finished on this rank
  auto from_parent = [&](std::size_t u) {
    comm.recv(piece(u), nodes[u % trees].parent, tree_tag(u, 1), tree_token(u, ev_parent));
  };
  auto down = [&](std::size_t u) {
    for (int c : nodes[u % trees].children)
      if (c >= 0) comm.send(ConstBuffer(piece(u)), c, tree_tag(u, 1), ev_send);
    --open;
    if (u % trees != inner) return;
    const std::size_t k = u / trees;
    for (std::size_t w = 0; w < trees; ++w)
      if (nodes[w].children[0] < 0 && !nodes[w].is_root()) from_parent(k * trees + w);
  };
  auto up = [&](std::size_t u) {
    const TreeNode& n = nodes[u % trees];
    if (n.is_root()) {
      if (broadcast_down) {
        comm.finish(piece(u), op);
        down(u);
      } else {
        --open;
      }
      return;
    }
    comm.send(ConstBuffer(piece(u)), n.parent, tree_tag(u, 0), ev_send);
    if (!broadcast_down) {
      --open;
    } else if (u % trees == inner || inner == trees) {
      from_parent(u);
    }
  };
  for (std::size_t u = 0; u < units; ++u) {
    const TreeNode& n = nodes[u % trees];
    left[u] = 0;
    for (std::size_t i = 0; i < 2; ++i) {
      if (n.children[i] < 0) continue;
      comm.recv_reduce(piece(u), n.children[i], tree_tag(u, 0), tree_token(u, i == 0 ? ev_child0 : ev_child1), op);
      ++left[u];
    }
    if (!left[u]) up(u);
  }
  while (open) {
    const std::uint32_t t = comm.wait_any();
    const std::size_t u = t >> 2;
    switch (t & 3u) {
      case ev_child0:
      case ev_child1:
        if (!--left[u]) up(u);
        break;
      case ev_parent: down(u); break;
      default: break;
    }
  }
}

/// Broadcast x down one tree in chunks (the root already holds x).
template <class B>
void tree_broadcast(CallView<B>& comm, Buffer x, const TreeNode& node, std::size_t k_chunks) {
  auto piece = [&](std::size_t k) {
    const Range c = block(x.size(), k_chunks, k);
    return x.subspan(c.begin, c.size());
  };
  auto down = [&](std::size_t k) {
    for (int c : node.children)
      if (c >= 0) comm.send(ConstBuffer(piece(k)), c, tree_tag(k, 1), ev_send);
  };
  if (node.is_root()) {
    for (std::size_t k = 0; k < k_chunks; ++k) down(k);
  } else {
    for (std::size_t k = 0; k < k_chunks; ++k) comm.recv(piece(k), node.parent, tree_tag(k, 1), tree_token(k, ev_parent));
    for (std::size_t left = k_chunks; left;) {
      const std::uint32_t t = comm.wait_any();
      if ((t & 3u) != ev_parent) continue;
      --left;
      down(t >> 2);
    }
  }
  comm.wait_all();
}

/// Gathers each subtree's contiguous blocks up one tree (in-order positions
/// equal ranks, so a subtree's blocks are contiguous in x), then broadcasts.
template <class B>
void tree_all_gather(CallView<B>& comm, Buffer x, std::size_t m, const Options& opt) {
  const int p = comm.size();
  const BinaryTree t{p};
  const int r = comm.rank();
  const TreeNode node = tree_node(t, r, [](int pos) { return pos; });
  auto blocks_of = [&](int pos) {
    const auto s = t.span(pos);
    return x.subspan(static_cast<std::size_t>(s[0]) * m, static_cast<std::size_t>(s[1] - s[0] + 1) * m);
  };
  int waiting = 0;
  for (int i = 0; i < 2; ++i) {
    const int c = node.children[static_cast<std::size_t>(i)];
    if (c < 0) continue;
    comm.recv(blocks_of(c), c, tree_tag(0, 0), tree_token(0, i == 0 ? ev_child0 : ev_child1));
    ++waiting;
  }
  while (waiting) {
    const std::uint32_t tok = comm.wait_any();
    if ((tok & 3u) == ev_child0 || (tok & 3u) == ev_child1) --waiting;
  }
  if (!node.is_root()) comm.send(ConstBuffer(blocks_of(r)), node.parent, tree_tag(0, 0), ev_send);
  comm.wait_all();
  tree_broadcast(comm, x, node, pieces_for(x.size(), chunk_bytes(opt) / x.element_size()));
}

template <>
struct Algorithm<Tree> {
  template <class B>
  static void all_reduce(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op,
                         const Options& opt) {
    const int p = comm.size();
    comm.copy(out, in);
    if (p == 1) return comm.finish(out, op);
    const int r = comm.rank();
    if (opt.deterministic) {
      const auto blocks = [&](int q) { return block(out.size(), static_cast<std::size_t>(p), static_cast<std::size_t>(q)); };
      const Range mine = blocks(r);
      ordered_reduce_scatter(comm, ConstBuffer(out), out.subspan(mine.begin, mine.size()), op, blocks);
      // Blocks of uneven size cannot be gathered as one contiguous run per
      // subtree, so the deterministic Tree all-gathers through a padded copy
      // only when the count does not divide; otherwise in place.
      const std::size_t m = (out.size() + static_cast<std::size_t>(p) - 1) / static_cast<std::size_t>(p);
      if (m * static_cast<std::size_t>(p) == out.size()) return tree_all_gather(comm, out, m, opt);
      auto padded = comm.scratch(out.type(), m * static_cast<std::size_t>(p), 2);
      comm.copy(padded.subspan(static_cast<std::size_t>(r) * m, mine.size()),
                ConstBuffer(out.subspan(mine.begin, mine.size())));
      tree_all_gather(comm, padded, m, opt);
      for (int q = 0; q < p; ++q) {
        const Range b = blocks(q);
        comm.copy(out.subspan(b.begin, b.size()), ConstBuffer(padded.subspan(static_cast<std::size_t>(q) * m, b.size())));
      }
      return;
    }
    const BinaryTree t{p};
    std::array<TreeNode, 2> nodes;
    std::array<Range, 2> halves;
    for (int w = 0; w < 2; ++w) {
      nodes[static_cast<std::size_t>(w)] = tree_node(t, double_tree_pos(r, p, w), [&](int pos) { return double_tree_rank(pos, p, w); });
      halves[static_cast<std::size_t>(w)] = block(out.size(), 2, static_cast<std::size_t>(w));
    }
    const std::size_t k_chunks = pieces_for(halves[0].size(), chunk_bytes(opt) / out.element_size());
    tree_reduce(comm, out, op, std::span<const TreeNode>(nodes), std::span<const Range>(halves), k_chunks, true);
    comm.wait_all();
  }

  template <class B>
  static void reduce_scatter(CallView<B>& comm, ConstBuffer in, Buffer out, OpKind op,
                             const Options& opt) {
    if (reduce_scatter_in_rank_order(comm, in, out, op, opt)) return;
    const int r = comm.rank();
    const BinaryTree t{comm.size()};
    const std::size_t m = out.size();
    const TreeNode node = tree_node(t, r, [](int pos) { return pos; });
    auto work = comm.scratch(in.type(), in.size());
    comm.copy(work, in);
    const Range all{0, work.size()};
    tree_reduce(comm, work, op, std::span<const TreeNode>(&node, 1), std::span<const Range>(&all, 1),
                    pieces_for(work.size(), chunk_bytes(opt) / work.element_size()), false);
    // Scatter: each subtree receives its blocks, fully reduced, from above.
    auto blocks_of = [&](int pos) {
      const auto s = t.span(pos);
      return work.subspan(static_cast<std::size_t>(s[0]) * m, static_cast<std::size_t>(s[1] - s[0] + 1) * m);
    };
    if (!node.is_root()) {
      comm.recv(blocks_of(r), node.parent, tree_tag(0, 1), tree_token(0, ev_parent));
      wait_for(comm, tree_token(0, ev_parent));
    }
    for (int c : node.children)
      if (c >= 0) comm.send(ConstBuffer(blocks_of(c)), c, tree_tag(0, 1), ev_send);
    comm.wait_all();
    comm.copy(out, ConstBuffer(work.subspan(EqualBlocks{m}(r).begin, m)));
    comm.finish(out, op);
  }

  template <class B>
  static void all_gather(CallView<B>& comm, ConstBuffer in, Buffer out, const Options& opt) {
    const std::size_t m = in.size();
    comm.copy(out.subspan(m * static_cast<std::size_t>(comm.rank()), m), in);
    if (comm.size() == 1) return;
    tree_all_gather(comm, out, m, opt);
  }

  template <class B>
  static void broadcast(CallView<B>& comm, Buffer buf, int root, const Options& opt) {
    const int p = comm.size();
    if (p == 1) return;
    const BinaryTree t{p};
    const int shift = t.root() - root;
    const TreeNode node = tree_node(t, mod(comm.rank() + shift, p), [&](int pos) { return mod(pos - shift, p); });
    tree_broadcast(comm, buf, node, pieces_for(buf.size(), chunk_bytes(opt) / buf.element_size()));
  }
};

}  // namespace gradsync::detail
