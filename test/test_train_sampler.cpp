// DistributedSampler follows torch.utils.data.DistributedSampler's rules.
#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>

#include "support/instances.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <set>
#include <vector>

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_sampler {

using gradsync::DistributedSampler;
using gradsync::SamplerOptions;

TEST_CASE("num_samples is ceil(L/N), or ceil((L-N)/N) with drop_last when N does not divide L") {
  CHECK(DistributedSampler(10, 3, 0, {.drop_last = false}).num_samples() == 4);
  CHECK(DistributedSampler(10, 3, 0, {.drop_last = true}).num_samples() == 3);
  CHECK(DistributedSampler(9, 3, 0, {.drop_last = true}).num_samples() == 3);
  CHECK(DistributedSampler(2, 3, 0, {.drop_last = true}).num_samples() == 0);
  CHECK(DistributedSampler(2, 3, 0, {.drop_last = false}).num_samples() == 1);
  CHECK(DistributedSampler(0, 3, 0).num_samples() == 0);
  CHECK(DistributedSampler(10, 3, 0).total_size() == 12);
}

TEST_CASE("without shuffle rank r takes r, r+N, r+2N, ... and padding repeats from the start") {
  const SamplerOptions o{.shuffle = false};
  CHECK(DistributedSampler(10, 3, 0, o).indices() == std::vector<std::size_t>{0, 3, 6, 9});
  CHECK(DistributedSampler(10, 3, 1, o).indices() == std::vector<std::size_t>{1, 4, 7, 0});
  CHECK(DistributedSampler(10, 3, 2, o).indices() == std::vector<std::size_t>{2, 5, 8, 1});
  // Padding longer than the data cycles: L = 2, N = 5 -> 0 1 0 1 0.
  CHECK(DistributedSampler(2, 5, 4, o).indices() == std::vector<std::size_t>{0});
  CHECK(DistributedSampler(2, 5, 3, o).indices() == std::vector<std::size_t>{1});
  SamplerOptions drop = o;
  drop.drop_last = true;
  CHECK(DistributedSampler(10, 3, 2, drop).indices() == std::vector<std::size_t>{2, 5, 8});
}

TEST_CASE("shuffle is seeded by seed + epoch, through set_epoch") {
  DistributedSampler a(100, 1, 0, {.seed = 5}), b(100, 1, 0, {.seed = 4});
  const auto e0 = a.indices();
  a.set_epoch(1);
  const auto e1 = a.indices();
  CHECK(e0 != e1);
  b.set_epoch(2);  // 4 + 2 == 5 + 1
  CHECK(b.indices() == e1);
  auto sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::size_t> iota(100);
  std::iota(iota.begin(), iota.end(), std::size_t{0});
  CHECK(sorted == iota);
}

TEST_CASE("shards: disjoint, covering, equal in size, and every rank agrees on them") {
  for (int world : {1, 2, 3, 4}) {
    for (std::size_t length : {std::size_t{0}, std::size_t{7}, std::size_t{12}, std::size_t{101}}) {
      for (bool drop : {false, true}) {
        CAPTURE(world);
        CAPTURE(length);
        CAPTURE(drop);
        // Each rank builds its sampler on its own thread; they exchange shards.
        const SamplerOptions o{.seed = 11, .drop_last = drop};
        std::vector<std::vector<std::int64_t>> seen(static_cast<std::size_t>(world));
        gradsync::run_threads(world, [&](gradsync::Communicator<gradsync::Threads>& comm) {
          DistributedSampler s(length, comm.size(), comm.rank(), o);
          s.set_epoch(3);
          const auto mine = s.indices();
          std::vector<std::int64_t> m(mine.begin(), mine.end());
          std::vector<std::int64_t> all(m.size() * static_cast<std::size_t>(comm.size()));
          gradsync::AllGather<gradsync::Ring>{}(comm, std::span<const std::int64_t>(m), std::span<std::int64_t>(all));
          seen[static_cast<std::size_t>(comm.rank())] = all;
        });
        for (const auto& v : seen) CHECK(v == seen[0]);  // every rank sees the same shards
        const auto& all = seen[0];
        const std::size_t per = DistributedSampler(length, world, 0, o).num_samples();
        CHECK(all.size() == per * static_cast<std::size_t>(world));  // equal sizes
        std::set<std::int64_t> distinct(all.begin(), all.end());
        if (drop) {
          CHECK(distinct.size() == all.size());  // disjoint
          CHECK(all.size() >= length - length % static_cast<std::size_t>(world));
        } else {
          CHECK(distinct.size() == length);  // covers everything
          // Disjoint apart from the padding, which is < N repeats.
          CHECK(all.size() - distinct.size() < static_cast<std::size_t>(world));
        }
        for (auto i : all) CHECK((i >= 0 && static_cast<std::size_t>(i) < length));
      }
    }
  }
}

}  // namespace test_train_sampler
