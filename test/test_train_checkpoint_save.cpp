// Saving checkpoints when the file system refuses: every failure is a
// gradsync::Error (a FileError) on every rank, naming the failing rank, the
// path and the system's reason; the checkpoint the directory held before
// still loads, bit for bit; the directory's commit file decides what loads.
#include <doctest/doctest.h>

#include <gradsync/checkpoint/file_ops.hpp>
#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/replicated_checkpoint.hpp>
#include <gradsync/train/checkpoint/sharded_checkpoint.hpp>

#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "support/common.hpp"
#include "test_train_checkpoint.hpp"
#include "test_train_model.hpp"

// Everything in this file is in its own namespace: test/meson.build compiles
// it in one translation unit with other test files (a unity build).
namespace test_train_checkpoint_save {

namespace ck = gradsync::checkpoint;
using namespace test_checkpoint::names;
using FileOp = ck::detail::FileOp;

namespace {

constexpr std::size_t in = 4, out = 2;
const std::vector<std::size_t> layers{in, 5, 3, out};

Mlp<float> model() { return {layers, 3}; }

template <class Trainer>
void train(Trainer& t, int steps) {
  for (int s = 0; s < steps; ++s) {
    const std::size_t first = t.step_count() * 8 + 2 * std::size_t(t.communicator().rank());
    t.step(test_train::make_batch<float>(first, 2, in, out));
  }
}

/// What a checkpoint holds, as a ReplicatedTrainer on one rank loads it:
/// parameters, buffers, each optimizer buffer and the step counts.
struct Loaded {
  std::vector<float> params, buffers;
  std::vector<std::vector<float>> opt;
  std::uint64_t opt_steps = 0;
  std::size_t steps = 0;
  bool operator==(const Loaded&) const = default;
};

Loaded load(const fs::path& path) {
  Loaded l;
  gradsync::run_threads(1, [&](Communicator<Threads>& comm) {
    ReplicatedTrainer t(comm, Mlp<float>{layers, 77}, test_checkpoint::adam(0.5), exact_replicated());
    gradsync::load_checkpoint(t, path);
    l.params.assign(t.parameters().begin(), t.parameters().end());
    l.buffers.assign(t.buffers().begin(), t.buffers().end());
    const auto st = t.optimizer().state();
    for (const auto& b : st.buffers) l.opt.emplace_back(b.second.begin(), b.second.end());
    l.opt_steps = st.steps;
    l.steps = t.step_count();
  });
  return l;
}

/// The files of `dir`, sorted.
std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

/// Only the commit file and the committed generation's files.
void check_only_committed(const fs::path& dir) {
  const std::string committed = gradsync::checkpoint_file(dir).filename().string();
  const std::string generation = committed.substr(0, committed.find_first_of(".-", std::string("checkpoint-").size()));
  for (const std::string& n : listing(dir)) {
    CAPTURE(n);
    CHECK((n == "checkpoint.commit" || n.starts_with(generation + ".") || n.starts_with(generation + "-")));
  }
}

using Outcome = test_checkpoint::SaveOutcome;

template <class Save>
Outcome outcome_of(Save save) {
  return test_checkpoint::save_outcome_of(save);
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Every rank threw a FileError of `err` on `path`, naming rank `failing`
/// (or, when it is -1, each rank itself) and the system's reason.
void all_refused(const std::vector<Outcome>& got, int err, int failing, const std::string& path) {
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    CAPTURE(got[r].what);
    CHECK(got[r].type == "FileError");
    CHECK(got[r].os_error == err);
    CHECK(contains(got[r].what, "failed on rank " + std::to_string(failing < 0 ? int(r) : failing)));
    CHECK(contains(got[r].what, std::strerror(err)));
    CHECK(contains(got[r].what, std::string(ck::detail::remedy(err))));
    if (!path.empty()) {
      CHECK(contains(got[r].what, path));
      CHECK(got[r].path.starts_with(path));
    }
  }
}

// The hook's state. Each rank's thread sets its own copy (thread_local), so
// the ranks never share what the hook reads; each rank's trace is its own
// slot of a vector sized before the ranks start.
thread_local int hook_rank = -1;
thread_local long hook_ops = 0;
thread_local int fail_rank = -1;
thread_local long fail_at = 0;
thread_local int fail_errno = 0;
thread_local std::vector<std::pair<FileOp, fs::path>>* hook_trace = nullptr;
thread_local fs::path* failed_path = nullptr;

int counting_hook(FileOp op, const fs::path& path) {
  if (hook_rank < 0) return 0;
  ++hook_ops;
  if (hook_trace) hook_trace->emplace_back(op, path);
  if (hook_rank == fail_rank && hook_ops == fail_at) {
    if (failed_path) *failed_path = path;
    return fail_errno;
  }
  return 0;
}

/// Sets the hook for a test case and clears it after, whatever happens.
struct HookGuard {
  HookGuard() { ck::detail::file_op_hook = counting_hook; }
  HookGuard(const HookGuard&) = delete;
  HookGuard& operator=(const HookGuard&) = delete;
  ~HookGuard() { ck::detail::file_op_hook = nullptr; }
};

const char* format_name(CheckpointFormat f) { return f == CheckpointFormat::full ? "full" : "sharded"; }

/// One randomized trial: save A, then a save B in which rank r's k-th file
/// operation fails with errno e (r, k and e drawn from `rng` among the
/// operations that a save from the same state makes, counted on a copy).
template <class Make>
void failing_save_trial(std::mt19937_64& rng, int world, const fs::path& target, CheckpointFormat format,
                        Make make) {
  // What holds the checkpoint (the directory, or a .safetensors file's directory), and two copies of it beside it.
  const bool in_directory = target.extension() != ".safetensors";
  const fs::path container = in_directory ? target : target.parent_path();
  const fs::path reference = container.parent_path() / "reference", probe = container.parent_path() / "probe";
  auto in = [&](const fs::path& c) { return in_directory ? c : c / target.filename(); };
  const int errors[] = {ENOSPC, EDQUOT, EIO, EROFS, EACCES};
  const int err = errors[rng() % std::size(errors)];
  const std::uint64_t pick = rng();
  std::vector<std::vector<std::pair<FileOp, fs::path>>> traces(static_cast<std::size_t>(world));
  std::vector<Outcome> got(static_cast<std::size_t>(world));
  int r = -1;
  long k = 0;
  fs::path refused;
  HookGuard hook;
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    const auto me = std::size_t(comm.rank());
    auto t = make(comm);
    train(t, 2);
    gradsync::save_checkpoint(t, target, {{"which", "A"}}, {.format = format});
    // Rank 0 copies A before its save into the probe starts; the others wait in that save's first collective.
    if (me == 0) {
      fs::copy(container, reference, fs::copy_options::recursive);
      fs::copy(container, probe, fs::copy_options::recursive);
    }
    train(t, 1);
    hook_rank = comm.rank();
    hook_ops = 0;
    hook_trace = &traces[me];
    gradsync::save_checkpoint(t, in(probe), {{"which", "B"}}, {.format = format});
    hook_trace = nullptr;
    // Every rank learns every rank's count and draws the same failing operation.
    const std::int64_t mine = hook_ops;
    std::vector<std::int64_t> counts(static_cast<std::size_t>(world));
    gradsync::AllGather<gradsync::Ring>{}(comm, std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(counts));
    std::int64_t all = 0;
    for (const auto c : counts) all += c;
    // No operation went through the hook: nothing to fail (r stays -1, and the REQUIRE below says so).
    if (all == 0) return;
    auto at = static_cast<std::int64_t>(pick % static_cast<std::uint64_t>(all));
    int rank = 0;
    while (at >= counts[std::size_t(rank)]) at -= counts[std::size_t(rank++)];
    fail_rank = rank;
    fail_at = at + 1;
    fail_errno = err;
    failed_path = &refused;
    hook_ops = 0;
    if (me == 0) r = rank, k = fail_at;
    got[me] = outcome_of([&] { gradsync::save_checkpoint(t, target, {{"which", "B"}}, {.format = format}); });
    hook_rank = -1;
    fail_rank = -1;
    failed_path = nullptr;
  });
  CAPTURE(r);
  CAPTURE(k);
  CAPTURE(std::string(std::strerror(err)));
  // Every save makes file operations, and each goes through the hook first.
  REQUIRE(r >= 0);
  const auto& trace = traces[std::size_t(r)];
  REQUIRE(std::size_t(k) <= trace.size());
  const FileOp op = trace[std::size_t(k - 1)].first;
  CAPTURE(std::string(ck::detail::op_name(op)));
  CAPTURE(trace[std::size_t(k - 1)].second);
  // Rank 0's rename of the commit file (to a .safetensors path: of the file itself) is the commit.
  const fs::path commit_file = in_directory ? probe / "checkpoint.commit" : in(probe);
  std::size_t commit = 0;
  for (std::size_t i = 0; i < traces[0].size(); ++i) {
    if (traces[0][i].first == FileOp::rename && traces[0][i].second == commit_file) commit = i + 1;
  }
  REQUIRE(commit > 0);
  const Loaded a = load(in(reference)), b = load(in(probe)), now = load(target);
  REQUIRE(!(a == b));
  if (r != 0 || std::size_t(k) <= commit) {
    // Before the commit: every rank throws, naming the failing rank and the path refused; A loads.
    all_refused(got, err, r, refused.string());
    CHECK(now == a);
  } else if (op == FileOp::list_directory || op == FileOp::remove) {
    // The clean-up once B is committed (listing the directory, removing A's files): the save
    // succeeds, and what is left stays for the next save to remove.
    for (const Outcome& o : got) CHECK(o.what == "");
    CHECK(now == b);
  } else {
    // The fsync of the directory after the commit's rename: B is in place, maybe not durably, so every rank throws.
    all_refused(got, err, r, refused.string());
    CHECK(now == b);
  }
}

}  // namespace

TEST_CASE("save failures: a refused file operation on any rank is a FileError on every rank; the previous checkpoint loads bitwise") {
  auto rng = test::rng_for("failing saves");
  CAPTURE(test::test_seed());
  for (int trial = 0; trial < 40; ++trial) {
    const int world = 3 + int(rng() % 3);
    const bool sharded_trainer = rng() % 2 == 0;
    const CheckpointFormat format = rng() % 2 ? CheckpointFormat::sharded : CheckpointFormat::full;
    const bool file_path = format == CheckpointFormat::full && rng() % 4 == 0;
    CAPTURE(trial);
    CAPTURE(world);
    CAPTURE(sharded_trainer);
    CAPTURE(std::string(format_name(format)));
    TempDir dir;
    const fs::path target = file_path ? dir.path / "a" / "model.safetensors" : dir.path / "ckpt";
    if (sharded_trainer) {
      failing_save_trial(rng, world, target, format, [](Communicator<Threads>& comm) {
        return ShardedTrainer(comm, model(), test_checkpoint::adam(), exact_sharded());
      });
    } else {
      failing_save_trial(rng, world, target, format, [](Communicator<Threads>& comm) {
        return ReplicatedTrainer(comm, model(), test_checkpoint::adam(), exact_replicated());
      });
    }
    if (file_path) continue;
    // The directory takes the next save, which leaves only its own files (a failed save's are gone).
    gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
      ShardedTrainer t(comm, model(), test_checkpoint::adam(), exact_sharded());
      train(t, 4);
      gradsync::save_checkpoint(t, target, {}, {.format = format});
    });
    CHECK(load(target).steps == 4);
    check_only_committed(target);
  }
}

namespace {

using Sharded = ShardedTrainer<Mlp<float>, gradsync::Adam<float>, Communicator<Threads>>;

/// Saves step `steps` of a ShardedTrainer on `world` ranks (each rank
/// writes its own shard file in the sharded format); what each rank got.
std::vector<Outcome> save_steps(int world, int steps, const fs::path& target,
                                CheckpointFormat format = CheckpointFormat::sharded) {
  std::vector<Outcome> got(static_cast<std::size_t>(world));
  gradsync::run_threads(world, [&](Communicator<Threads>& comm) {
    Sharded t(comm, model(), test_checkpoint::adam(), exact_sharded());
    train(t, steps);
    hook_rank = comm.rank();
    hook_ops = 0;
    got[std::size_t(comm.rank())] = outcome_of([&] { gradsync::save_checkpoint(t, target, {}, {.format = format}); });
    hook_rank = -1;
  });
  return got;
}

void all_saved(const std::vector<Outcome>& got) {
  for (const Outcome& o : got) {
    CAPTURE(o.what);
    CHECK(o.type == "");
  }
}

/// Makes rank `rank`'s first operation `op` of the next save fail with `err`
/// (the stand-in where the system cannot be made to refuse), until destroyed.
struct Injected {
  static inline FileOp op;
  static inline int rank = 0, err = 0;
  static inline bool done = false;
  Injected(FileOp o, int r, int e) {
    op = o, rank = r, err = e, done = false;
    ck::detail::file_op_hook = [](FileOp o, const fs::path&) {
      if (o != op || hook_rank != rank || done) return 0;
      done = true;
      return err;
    };
  }
  Injected(const Injected&) = delete;
  Injected& operator=(const Injected&) = delete;
  ~Injected() { ck::detail::file_op_hook = nullptr; }
};

/// A tmpfs of `size` mounted on `at` while this lives, where the system
/// lets this process mount one (root with CAP_SYS_ADMIN).
struct Tmpfs {
  fs::path at;
  bool mounted = false;
  Tmpfs(fs::path where, const char* size) : at(std::move(where)) {
    fs::create_directories(at);
    mounted = ::mount("tmpfs", at.c_str(), "tmpfs", 0, (std::string("size=") + size).c_str()) == 0;
  }
  Tmpfs(const Tmpfs&) = delete;
  Tmpfs& operator=(const Tmpfs&) = delete;
  ~Tmpfs() {
    if (mounted) ::umount2(at.c_str(), MNT_DETACH);
  }
  bool remount_read_only() const {
    return ::mount("tmpfs", at.c_str(), "tmpfs", MS_REMOUNT | MS_RDONLY, nullptr) == 0;
  }
};

/// Runs as user `uid` (effective) while this lives, if the system lets it.
struct EffectiveUser {
  bool changed = false;
  explicit EffectiveUser(uid_t uid) { changed = ::geteuid() != uid && ::seteuid(uid) == 0; }
  EffectiveUser(const EffectiveUser&) = delete;
  EffectiveUser& operator=(const EffectiveUser&) = delete;
  ~EffectiveUser() {
    if (changed) CHECK(::seteuid(0) == 0);
  }
};

}  // namespace

TEST_CASE("save failures the system gives: a path through a file, a name too long, no permission, a read-only or a full file system") {
  constexpr int world = 3;
  TempDir dir;
  const fs::path blocker = dir.path / "a-file";
  std::ofstream(blocker) << "not a directory";

  SUBCASE("a path that is a file, or that passes through one: ENOTDIR on every rank, naming the path") {
    for (const auto format : {CheckpointFormat::sharded, CheckpointFormat::full}) {
      CAPTURE(std::string(format_name(format)));
      all_refused(save_steps(world, 1, blocker, format), ENOTDIR, 0, blocker.string());
      all_refused(save_steps(world, 1, blocker / "ckpt", format), ENOTDIR, 0, blocker.string());
    }
    all_refused(save_steps(world, 1, blocker / "x.safetensors", CheckpointFormat::full), ENOTDIR, 0, blocker.string());
    CHECK(listing(dir.path) == std::vector<std::string>{"a-file"});
  }

  SUBCASE("a name too long: ENAMETOOLONG on every rank, naming the path") {
    const fs::path longer = dir.path / std::string(300, 'n');
    all_refused(save_steps(world, 1, longer / "ckpt"), ENAMETOOLONG, 0, longer.string());
    const fs::path file = dir.path / (std::string(250, 'n') + ".safetensors");
    all_refused(save_steps(world, 1, file, CheckpointFormat::full), ENAMETOOLONG, 0, dir.path.string());
    CHECK(listing(dir.path) == std::vector<std::string>{"a-file"});
  }

  SUBCASE("a directory this process may not write: EACCES on every rank; the previous checkpoint loads") {
    const fs::path ckpt = dir.path / "ckpt";
    all_saved(save_steps(world, 2, ckpt));
    const Loaded before = load(ckpt);
    fs::permissions(ckpt, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                              fs::perms::group_exec | fs::perms::others_read | fs::perms::others_exec);
    std::vector<Outcome> got;
    {
      // Root writes anywhere: as root the save runs as "nobody", which cannot write there.
      EffectiveUser nobody(::geteuid() == 0 ? 65534 : ::geteuid());
      if (::geteuid() == 0) {
        MESSAGE("cannot leave root here: the refusal is injected (EACCES)");
        Injected refuse(FileOp::create, 0, EACCES);
        got = save_steps(world, 3, ckpt);
        all_refused(got, EACCES, 0, ckpt.string());
      } else {
        got = save_steps(world, 3, ckpt);
        // Each rank creates its own shard file, and each is refused.
        all_refused(got, EACCES, -1, ckpt.string());
      }
    }
    fs::permissions(ckpt, fs::perms::owner_all, fs::perm_options::add);
    CHECK(load(ckpt) == before);
    CHECK(before.steps == 2);
  }

  SUBCASE("a read-only file system: EROFS on every rank; the previous checkpoint loads") {
    Tmpfs fsys(dir.path / "mnt", "1m");
    const fs::path ckpt = fsys.at / "ckpt";
    all_saved(save_steps(world, 2, ckpt));
    const Loaded before = load(ckpt);
    if (fsys.mounted && fsys.remount_read_only()) {
      all_refused(save_steps(world, 3, ckpt), EROFS, -1, ckpt.string());
    } else {
      MESSAGE("cannot mount a tmpfs here: the refusal is injected (EROFS)");
      Injected refuse(FileOp::create, 1, EROFS);
      all_refused(save_steps(world, 3, ckpt), EROFS, 1, ckpt.string());
    }
    CHECK(load(ckpt) == before);
  }

  SUBCASE("a full file system: ENOSPC on every rank; the previous checkpoint loads; the next save cleans up") {
    Tmpfs fsys(dir.path / "mnt", "256k");
    const fs::path ckpt = fsys.at / "ckpt";
    all_saved(save_steps(world, 2, ckpt));
    const Loaded before = load(ckpt);
    const std::vector<std::string> files = listing(ckpt);
    if (fsys.mounted) {
      // Fill it to the last byte.
      std::ofstream filler(fsys.at / "filler", std::ios::binary);
      const std::string block(4096, 'x');
      while (filler.write(block.data(), std::streamsize(block.size())) && filler.flush()) {
      }
      filler.close();
      all_refused(save_steps(world, 3, ckpt), ENOSPC, -1, ckpt.string());
      fs::remove(fsys.at / "filler");
      // A failed save takes its temporaries with it.
      CHECK(listing(ckpt) == files);
    } else {
      MESSAGE("cannot mount a tmpfs here: the refusal is injected (ENOSPC)");
      Injected refuse(FileOp::write, 2, ENOSPC);
      all_refused(save_steps(world, 3, ckpt), ENOSPC, 2, ckpt.string());
    }
    CHECK(load(ckpt) == before);
    all_saved(save_steps(world, 4, ckpt));
    CHECK(load(ckpt).steps == 4);
    check_only_committed(ckpt);
  }
}

TEST_CASE("the commit file decides what loads: leftovers are ignored and then removed, older directories load") {
  TempDir dir;
  auto write_file = [](const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; };

  SUBCASE("files of an uncommitted generation are ignored by a load, and removed by the next save") {
    const fs::path ckpt = dir.path / "ckpt";
    all_saved(save_steps(2, 2, ckpt, CheckpointFormat::full));
    const Loaded a = load(ckpt);
    write_file(ckpt / "checkpoint-00000009.safetensors", "half a file");
    write_file(ckpt / "checkpoint-00000009-rank00001-of-00002.safetensors", "half a shard");
    write_file(ckpt / ".checkpoint-00000009.index.json.tmp-1-2-3", "a temporary");
    CHECK(load(ckpt) == a);
    all_saved(save_steps(2, 3, ckpt));
    // The next generation is past every one named in the directory: nothing of it was ever written before.
    CHECK(gradsync::checkpoint_file(ckpt) == ckpt / "checkpoint-00000010.index.json");
    CHECK(load(ckpt).steps == 3);
    check_only_committed(ckpt);
  }

  SUBCASE("a directory saved before commit files, full or sharded, still loads; a save there replaces its layout") {
    const fs::path full = dir.path / "full", sharded = dir.path / "sharded";
    // The older full layout is a file at this very name.
    all_saved(save_steps(2, 2, full / "checkpoint.safetensors", CheckpointFormat::full));
    // The older sharded layout: its index under a fixed name, no commit file.
    all_saved(save_steps(2, 3, sharded));
    fs::rename(gradsync::checkpoint_file(sharded), sharded / "checkpoint.index.json");
    fs::remove(sharded / "checkpoint.commit");
    CHECK(gradsync::checkpoint_file(full) == full / "checkpoint.safetensors");
    CHECK(gradsync::checkpoint_file(sharded) == sharded / "checkpoint.index.json");
    CHECK(load(full).steps == 2);
    CHECK(load(sharded).steps == 3);
    all_saved(save_steps(2, 4, full));
    all_saved(save_steps(2, 5, sharded, CheckpointFormat::full));
    CHECK(load(full).steps == 4);
    CHECK(load(sharded).steps == 5);
    check_only_committed(full);
    check_only_committed(sharded);
  }

  SUBCASE("an older directory holding both layouts, a damaged commit file, no checkpoint: errors that say which") {
    const fs::path both = dir.path / "both";
    all_saved(save_steps(2, 2, both / "checkpoint.safetensors", CheckpointFormat::full));
    all_saved(save_steps(2, 3, dir.path / "s"));
    fs::rename(gradsync::checkpoint_file(dir.path / "s"), both / "checkpoint.index.json");
    const auto refused = [](const fs::path& p) {
      return outcome_of([&] { load(p); });
    };
    const Outcome ambiguous = refused(both);
    CHECK(ambiguous.type == "InvalidArgument");
    CHECK(contains(ambiguous.what, "has no 'checkpoint.commit' and holds both"));

    const fs::path ckpt = dir.path / "ckpt";
    all_saved(save_steps(2, 2, ckpt));
    fs::resize_file(ckpt / "checkpoint.commit", 20);
    const Outcome damaged = refused(ckpt);
    CHECK(damaged.type == "Error");
    CHECK(contains(damaged.what, "commit file '" + (ckpt / "checkpoint.commit").string() + "' is not valid JSON"));

    const Outcome none = refused(dir.path / "nowhere");
    CHECK(none.type == "FileError");
    CHECK(none.os_error == ENOENT);
    CHECK(contains(none.what, "cannot open '" + (dir.path / "nowhere" / "checkpoint.commit").string() + "'"));
  }
}

}  // namespace test_train_checkpoint_save
