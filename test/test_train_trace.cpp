// The trainers on the timeline: one ShardedTrainer step per strategy on 3
// ranks (HybridShard on 4) has exactly the collectives its strategy issues, on the progress
// worker's track inside the step's span, beside the compute of each unit;
// a ReplicatedTrainer step has its buckets, its optimizer step and its
// checkpoint save and load; an asynchronous save's write has a track of its own. GRADSYNC_TRACE_TEST_DIR keeps the files for
// test/trace/trace_test.py, which parses them and runs tools/trace-summary.

#include <doctest/doctest.h>

#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/async_checkpointer.hpp>
#include <gradsync/train/checkpoint/replicated_checkpoint.hpp>

#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "support/common.hpp"
#include "support/temp_dir.hpp"
#include "support/trace_events.hpp"
#include "test_train_sharded_schedule.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_trace {

using namespace test_schedule;

namespace {

/// Where the timelines go: GRADSYNC_TRACE_TEST_DIR (kept), else a fresh temporary directory.
struct TraceOut {
  std::filesystem::path dir() const {
    const char* keep = std::getenv("GRADSYNC_TRACE_TEST_DIR");
    return keep ? std::filesystem::path(keep) : temp.path;
  }
  test::TempDir temp;
};

/// Collective name -> how many are on `track` within the span named `span`.
std::map<std::string, std::size_t> collectives_within(const test::TraceFile& f, const std::string& track,
                                                      const std::string& span) {
  double from = -1, to = -1;
  for (const test::TraceLine& e : f.events) {
    if (e.name == span) from = e.ts, to = e.ts + e.dur;
  }
  std::map<std::string, std::size_t> n;
  for (const test::TraceLine& e : f.events) {
    if (e.cat == "communication" && test::trace_field(e.line, "seq") != "" && f.thread_names.at(e.tid) == track &&
        e.ts >= from && e.ts + e.dur <= to) {
      ++n[e.name];
    }
  }
  return n;
}

std::size_t named(const test::TraceFile& f, const std::string& prefix) {
  std::size_t n = 0;
  for (const test::TraceLine& e : f.events) n += e.name.starts_with(prefix) ? 1 : 0;
  return n;
}

/// Rank `r`'s timeline in `dir`, read back.
test::TraceFile timeline_of(const std::filesystem::path& dir, int r) {
  return test::read_trace(dir / ("gradsync-trace-rank" + std::to_string(r) + ".json"));
}

/// The ReplicatedTrainer cases' ranks.
constexpr int replicated_world = 3;

/// Runs `body(trainer, batches, r)` on rank r of 3, each tracing into `dir`
/// with a ReplicatedTrainer (SGD); `batches` are 2 steps of 3 samples a
/// rank, drawn from the test seed's stream `seed_name`.
template <class Body>
void traced_replicated(const char* seed_name, const std::filesystem::path& dir, Body body) {
  const Batches batches = random_batches(test::rng_for(seed_name)(), 2, replicated_world, 3);
  gradsync::run_threads(replicated_world, [&](Communicator<Threads>& comm) {
    comm.trace_to(dir.string());
    const auto r = static_cast<std::size_t>(comm.rank());
    ReplicatedTrainer trainer(comm, model_for(comm.rank()), gradsync::Sgd<float>({.lr = 0.05}));
    body(trainer, batches, r);
  });
}

}  // namespace

TEST_CASE("timeline: one ShardedTrainer step holds the collectives its strategy issues") {
  auto g = test::rng_for("timeline sharded step");
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  const TraceOut out;
  // 3 ranks; HybridShard at 4, two groups of 2, its replicas' all-reduces
  // on a split communicator, recorded in the same rank's file.
  const std::pair<ShardingStrategy, int> cases[] = {{ShardingStrategy::FullShard, 3},
                                                    {ShardingStrategy::ShardGradOp, 3},
                                                    {ShardingStrategy::NoShard, 3},
                                                    {ShardingStrategy::HybridShard, 4}};
  for (const auto& [strategy_of_case, world_of_case] : cases) {
    const ShardingStrategy strategy = strategy_of_case;
    const int world = world_of_case;
    const Batches batches = random_batches(g(), 1, world, 3);
    const std::string name(gradsync::name(strategy));
    INFO("strategy = " << name << ", world = " << world);
    const std::filesystem::path dir = out.dir() / name;
    std::vector<Trace> traces(world);
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      comm.trace_to(dir.string());
      const auto r = static_cast<std::size_t>(comm.rank());
      ShardedTrainer trainer(comm, model_for(comm.rank()), gradsync::Sgd<float>({.lr = 0.05}), options_for(strategy, world));
      trainer.step(batches[0][r]);
      traces[r] = trainer.trace();
    });
    // Without prefetch, keep_last_forward_unit on (the defaults).
    std::map<std::string, std::size_t> expected;
    for (const auto& e : expected_trace(strategy, unit_sizes.size(), true)) ++expected[std::string(gradsync::name(e.collective))];
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      const test::TraceFile f = timeline_of(dir, r);
      CHECK(collectives_within(f, "progress worker", "step 1") == expected);
      std::map<std::string, std::size_t> issued;
      for (const auto& e : traces[static_cast<std::size_t>(r)]) ++issued[std::string(gradsync::name(e.collective))];
      CHECK(issued == expected);
      // Each unit's forward and backward, on the rank's own thread.
      CHECK(named(f, "forward unit ") >= unit_sizes.size());
      CHECK(named(f, "backward unit ") >= unit_sizes.size());
      CHECK(named(f, "optimizer step") == 1);
      CHECK(named(f, strategy == ShardingStrategy::NoShard ? "all-reduce wrapped unit " : "reduce-scatter wrapped unit ") ==
            unit_sizes.size());
      // The labels in words, though the trainer that knew them is gone.
      const bool gathers = strategy != ShardingStrategy::NoShard;
      CHECK((f.text.find("step 1, all-gather of wrapped unit") != std::string::npos) == gathers);
    }
  }
}

TEST_CASE("timeline: a ReplicatedTrainer step holds its buckets, its optimizer step, a checkpoint's save and load") {
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  const TraceOut out;
  const test::TempDir checkpoints;
  const std::filesystem::path dir = out.dir() / "Replicated";
  std::size_t buckets = 0;
  traced_replicated("timeline replicated step", dir, [&](auto& trainer, const Batches& batches, std::size_t r) {
    for (const auto& step : batches) {
      trainer.forward_backward(step[r]);
      trainer.clip_grad_norm(1.0e9);
      trainer.optimizer_step();
    }
    gradsync::save_checkpoint(trainer, checkpoints.path / "ckpt");
    gradsync::load_checkpoint(trainer, checkpoints.path / "ckpt");
    if (r == 0) buckets = trainer.grad_sync().buckets().size();
  });
  for (int r = 0; r < replicated_world; ++r) {
    CAPTURE(r);
    const test::TraceFile f = timeline_of(dir, r);
    CHECK(named(f, "step ") == 2);
    CHECK(named(f, "all-reduce bucket ") == 2 * buckets);
    CHECK(named(f, "optimizer step") == 2);
    CHECK(named(f, "clip_grad_norm") == 2);
    CHECK(named(f, "forward unit ") >= 2 * unit_sizes.size());
    CHECK(named(f, "checkpoint save") == 1);
    CHECK(named(f, "checkpoint load") == 1);
  }
}

TEST_CASE("timeline: an asynchronous save's write is on its own track, inside save() to the end of wait()") {
  INFO("GRADSYNC_TEST_SEED = " << test::test_seed());
  const TraceOut out;
  const test::TempDir checkpoints;
  const std::filesystem::path dir = out.dir() / "AsyncSave";
  traced_replicated("timeline async save", dir, [&](auto& trainer, const Batches& batches, std::size_t r) {
    gradsync::AsyncCheckpointer ckpt(trainer);
    trainer.forward_backward(batches[0][r]);
    trainer.optimizer_step();
    ckpt.save(checkpoints.path / "ckpt.safetensors", {}, {.format = gradsync::CheckpointFormat::full});
    trainer.forward_backward(batches[1][r]);
    trainer.optimizer_step();
    ckpt.wait();
  });
  for (int r = 0; r < replicated_world; ++r) {
    CAPTURE(r);
    const test::TraceFile f = timeline_of(dir, r);
    const auto span = [&](const std::string& name) {
      std::vector<const test::TraceLine*> found;
      for (const test::TraceLine& e : f.events) {
        if (e.name == name) found.push_back(&e);
      }
      return found;
    };
    const auto saves = span("checkpoint save"), waits = span("checkpoint wait"), writes = span("checkpoint write");
    REQUIRE(saves.size() == 1);
    REQUIRE(waits.size() == 1);
    CHECK(waits[0]->ts >= saves[0]->ts + saves[0]->dur);
    CHECK(f.thread_names.at(waits[0]->tid) == "caller");
    // A full file is written by rank 0 alone.
    REQUIRE(writes.size() == (r == 0 ? 1u : 0u));
    if (r == 0) {
      const test::TraceLine& w = *writes[0];
      CHECK(f.thread_names.at(w.tid) == "checkpoint writer");
      CHECK(w.ts + 1.0 >= saves[0]->ts);
      CHECK(w.ts + w.dur <= waits[0]->ts + waits[0]->dur + 1.0);  // µs, each printed to 1 ns
      CHECK(w.cat == "checkpoint");
    }
  }
}

}  // namespace test_train_trace
