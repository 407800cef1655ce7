// Times save_checkpoint and load_checkpoint of a ReplicatedTrainer against
// writing (and reading) the same number of bytes with one plain write()
// (read()), in one run, on the same disk.
//
//   checkpoint_perf [--sizes 784,2048,2048,2048,10] [--ranks 1] [--repeats 5] [--dir DIR] [--sharded 1]
//                   [--async 1] [--reserve 1]
//
// --sharded 1: a ShardedTrainer (FullShard) instead, saved and loaded in both
// layouts: the full file (rank 0 writes while the ranks gather a unit at a
// time) and the sharded directory (every rank writes its own ranges, rank 0
// the index; a load reads only the ranges a rank owns).
//
// --async 1: also an AsyncCheckpointer's save to a file beside it: how long
// save() blocks the caller (the copy into its snapshot; the first save also
// allocates the snapshot) against the whole save (save() then wait() at once:
// the background write, its fsync and the commit), and the write's bandwidth
// against the disk's bound, which the tool measures itself in the same run
// and directory by running `dd if=/dev/zero of=DIR/... bs=1M count=MB
// oflag=direct` through popen (direct I/O: no page cache). In each repeat the
// asynchronous save runs first, before the synchronous one and the load, so
// that neither follows the other's write-back or the load's reads.
//
// --reserve 1 (with --async 1): the checkpointer's reserve() right after it
// is made, then one training step before the first save, as a training loop
// would reserve at its start: the first save() then finds its pages mapped.
//
// The default model is ddp_step's 10.0M-parameter MLP, with Adam (two state
// elements per parameter), so the file holds about 3 x 40 MB. Each figure is
// the median of --repeats runs. "plain write" is open + one write() + close
// (the data reaches the page cache only); "+ fsync" adds what a checkpoint
// must pay for durability. save_checkpoint adds the CRC-32 of every byte,
// the header, the rename and the directory's fsync; load_checkpoint reads on
// every rank, verifies every CRC and copies into the trainer. The CRC-32
// of the same bytes, alone, is the last row.

#include <gradsync/gradsync.hpp>
#include <gradsync/train/checkpoint/async_checkpointer.hpp>
#include <gradsync/train/checkpoint/replicated_checkpoint.hpp>
#include <gradsync/train/checkpoint/sharded_checkpoint.hpp>
#include "perf/shared_launches.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

/// A model with the units of an MLP and a trivial loss (half the sum of
/// squared parameters), enough to give Adam a step and so its state.
struct Mlp {
  using value_type = float;
  std::vector<int> sizes;

  std::vector<gradsync::UnitSpec> units() const {
    std::vector<gradsync::UnitSpec> u;
    for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
      const auto in = std::size_t(sizes[l]), out = std::size_t(sizes[l + 1]);
      u.push_back({"fc" + std::to_string(l + 1), {{"weight", {out, in}}, {"bias", {out}}}, {}});
    }
    return u;
  }
  void bind(std::span<const gradsync::UnitView<float>> views) {
    std::uint64_t s = 1;
    for (const auto& u : views)
      for (float& x : u.flat_params) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x = static_cast<float>(static_cast<double>(s >> 40) / double(1 << 24) - 0.5);
      }
  }
  double forward_backward(int, const gradsync::StepContext<float>& ctx) {
    // A forward ask of each unit first: a sharded trainer lends gradients on the second.
    for (std::size_t u = 0; u + 1 < sizes.size(); ++u) (void)ctx.params(u);
    for (std::size_t u = sizes.size() - 1; u-- > 0;) {
      const auto p = ctx.params(u);
      for (std::size_t i = 0; i < p->flat_params.size(); ++i) p->flat_grads[i] += p->flat_params[i];
      ctx.ready(u);
    }
    return 0;
  }
};

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what + ": " + std::strerror(errno));
}

/// Passes all of `data` through ::read or ::write, which may move less than
/// asked or be interrupted by a signal.
template <class Byte, class Syscall>
void transfer_all(int fd, std::span<Byte> data, Syscall syscall, const char* verb, const std::filesystem::path& p) {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = syscall(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    check(n > 0, verb + (" " + p.string()));
    done += std::size_t(n);
  }
}

void plain_write(const std::filesystem::path& p, std::span<const std::byte> data, bool sync) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  check(fd >= 0, "open " + p.string());
  transfer_all(fd, data, ::write, "write", p);
  if (sync) check(::fsync(fd) == 0, "fsync " + p.string());
  ::close(fd);
}

void plain_read(const std::filesystem::path& p, std::span<std::byte> data) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  check(fd >= 0, "open " + p.string());
  transfer_all(fd, data, ::read, "read", p);
  ::close(fd);
}

/// The MB/s dd reports for writing `mb` MiB of zeros to `file` with
/// O_DIRECT (its last line: "... copied, 0.5 s, 230 MB/s"), in MB of 10^6.
double dd_direct_mb_s(const std::filesystem::path& file, std::size_t mb) {
  const std::string cmd = "dd if=/dev/zero of='" + file.string() + "' bs=1M count=" + std::to_string(mb) +
                          " oflag=direct 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  check(p != nullptr, "popen " + cmd);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  const int rc = ::pclose(p);
  std::filesystem::remove(file);
  const std::size_t copied = out.find(" bytes");
  const std::size_t comma = out.find(", ", out.find("copied"));
  if (rc != 0 || copied == std::string::npos || comma == std::string::npos) {
    throw std::runtime_error("dd failed: " + cmd + ": " + out);
  }
  // "N bytes (...) copied, S s, ...": bytes over seconds, whatever unit dd chose to print.
  const double bytes = std::stod(out.substr(out.rfind('\n', copied) == std::string::npos ? 0 : out.rfind('\n', copied) + 1));
  const double secs = std::stod(out.substr(comma + 2));
  return bytes / secs / 1e6;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  std::size_t at = 0;
  while (at <= s.size()) {
    const std::size_t comma = std::min(s.find(',', at), s.size());
    v.push_back(std::stoi(s.substr(at, comma - at)));
    at = comma + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<int> sizes{784, 2048, 2048, 2048, 10};
  int ranks = 1, repeats = 5;
  bool sharded = false, async = false, reserve = false;
  std::filesystem::path dir = std::filesystem::temp_directory_path();
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw std::runtime_error(k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--sizes") sizes = parse_list(v);
    else if (k == "--ranks") ranks = std::stoi(v);
    else if (k == "--repeats") repeats = std::stoi(v);
    else if (k == "--dir") dir = v;
    else if (k == "--sharded") sharded = v == "1";
    else if (k == "--async") async = v == "1";
    else if (k == "--reserve") reserve = v == "1";
    else throw std::runtime_error("unknown option " + k +
                                  " (expected --sizes --ranks --repeats --dir --sharded --async --reserve)");
  }
  if (sizes.size() < 2 || ranks < 1 || repeats < 1) throw std::runtime_error("bad --sizes, --ranks or --repeats");
  // A directory of its own inside --dir, the only thing removed at the end.
  const std::filesystem::path work = dir / ("gradsync-checkpoint-perf-" + std::to_string(::getpid()));
  std::filesystem::create_directories(work);
  const std::filesystem::path ckpt = work / "ckpt.safetensors", plain = work / "plain.bin";

  std::vector<double> save_s, load_s, save_dir_s, load_dir_s, write_s, write_sync_s, read_s, crc_s;
  std::vector<double> async_blocked_s, async_total_s;
  double async_first_blocked = 0, reserve_s = 0, dd_mb_s = 0;
  std::size_t params = 0, file_bytes = 0, dir_bytes = 0, snapshot_bytes = 0;
  const std::filesystem::path ckpt_dir = work / "sharded", ckpt_path_async = work / "async.safetensors";
  auto measure = [&](auto& trainer, gradsync::Communicator<gradsync::Threads>& comm) {
    gradsync::DistributedSampler sampler(60000, comm.size(), comm.rank());
    trainer.step(0);
    // One checkpointer for all repeats, as a training loop keeps one: its snapshot is allocated once.
    std::optional<gradsync::AsyncCheckpointer<std::remove_reference_t<decltype(trainer)>>> saver;
    if (async) saver.emplace(trainer, sampler);
    if (async && reserve) {
      const double s = seconds_of([&] { saver->reserve(); });
      if (comm.rank() == 0) reserve_s = s;
      trainer.step(1);
    }
    for (int r = 0; r < repeats; ++r) {
      comm.barrier();
      double blocked = 0, total = 0;
      if (async) {
        total = seconds_of([&] {
          blocked = seconds_of([&] { saver->save(ckpt_path_async); });
          saver->wait();
        });
        comm.barrier();
        if (comm.rank() == 0) snapshot_bytes = saver->snapshot_bytes();
      }
      const double s = seconds_of([&] { gradsync::save_checkpoint(trainer, sampler, ckpt); });
      comm.barrier();
      const double l = seconds_of([&] { gradsync::load_checkpoint(trainer, sampler, ckpt); });
      comm.barrier();
      double sd = 0, ld = 0;
      if (sharded) {
        sd = seconds_of([&] {
          gradsync::save_checkpoint(trainer, sampler, ckpt_dir, {}, {.format = gradsync::CheckpointFormat::sharded});
        });
        comm.barrier();
        ld = seconds_of([&] { gradsync::load_checkpoint(trainer, sampler, ckpt_dir); });
        comm.barrier();
      }
      if (comm.rank() != 0) continue;
      if (async && r == 0) async_first_blocked = blocked;
      if (async) async_blocked_s.push_back(blocked), async_total_s.push_back(total);
      save_s.push_back(s);
      load_s.push_back(l);
      save_dir_s.push_back(sd);
      load_dir_s.push_back(ld);
    }
  };
  gradsync::run_threads(ranks, [&](gradsync::Communicator<gradsync::Threads>& comm) {
    if (sharded) {
      gradsync::ShardedTrainer trainer(comm, Mlp{sizes}, gradsync::Adam<float>());
      measure(trainer, comm);
      params = 0;
      for (std::size_t u = 0; u < trainer.unit_count(); ++u) params += trainer.unit_size(u);
    } else {
      gradsync::ReplicatedTrainer trainer(comm, Mlp{sizes}, gradsync::Adam<float>());
      measure(trainer, comm);
      params = trainer.parameters().size();
    }
    if (comm.rank() != 0) return;
    file_bytes = std::filesystem::file_size(ckpt);
    if (sharded) {
      for (const auto& e : std::filesystem::directory_iterator(ckpt_dir)) dir_bytes += e.file_size();
    }
    if (async) {
      // A file system without O_DIRECT (tmpfs) has no such bound: the table then says so.
      try {
        dd_mb_s = dd_direct_mb_s(work / "dd.bin", std::max<std::size_t>(1, file_bytes >> 20));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "checkpoint_perf: %s\n", e.what());
      }
    }
    // The same number of bytes, from memory already touched.
    std::vector<std::byte> bytes(file_bytes, std::byte{1});
    for (int r = 0; r < repeats; ++r) {
      write_s.push_back(seconds_of([&] { plain_write(plain, bytes, false); }));
      write_sync_s.push_back(seconds_of([&] { plain_write(plain, bytes, true); }));
      read_s.push_back(seconds_of([&] { plain_read(plain, bytes); }));
      std::uint32_t crc = 0;
      crc_s.push_back(seconds_of([&] { crc = gradsync::checkpoint::Crc32::of(bytes); }));
      if (crc == 0x12345678) std::printf("#\n");  // keeps the checksum from being optimised away
    }
  });
  std::filesystem::remove_all(work);

  const double mb = double(file_bytes) / 1e6;
  std::printf("# checkpoint_perf: %zu parameters, Adam, %s, %d rank(s), file %.1f MB, median of %d, in %s\n", params,
              sharded ? "ShardedTrainer (FullShard)" : "ReplicatedTrainer", ranks, mb, repeats, dir.c_str());
  if (sharded) std::printf("# sharded directory: %.1f MB in %d shard files and the index\n", double(dir_bytes) / 1e6, ranks);
  std::printf("# %-28s %10s %10s\n", "what", "seconds", "MB/s");
  auto row = [&](const char* what, const std::vector<double>& v) {
    const double t = median(v);
    std::printf("  %-28s %10.4f %10.0f\n", what, t, mb / t);
  };
  row(sharded ? "save_checkpoint (full file)" : "save_checkpoint", save_s);
  if (sharded) row("save_checkpoint (sharded)", save_dir_s);
  row("plain write()", write_s);
  row("plain write() + fsync", write_sync_s);
  row(sharded ? "load_checkpoint (full file)" : "load_checkpoint (every rank)", load_s);
  if (sharded) row("load_checkpoint (sharded)", load_dir_s);
  row("plain read()", read_s);
  row("CRC-32 of the bytes", crc_s);
  if (async) {
    const double sync = median(save_s), blocked = median(async_blocked_s), total = median(async_total_s);
    std::printf("# AsyncCheckpointer, full file beside the synchronous one; snapshot %.1f MB on rank 0\n", double(snapshot_bytes) / 1e6);
    row("async save(): caller blocked", async_blocked_s);
    if (reserve) {
      std::printf("  %-28s %10.4f %10s\n", "  reserve() returned in", reserve_s, "");
      std::printf("  %-28s %10.4f %10s\n", "  first save() (reserved)", async_first_blocked, "");
    } else {
      std::printf("  %-28s %10.4f %10s\n", "  first save() (allocates)", async_first_blocked, "");
    }
    row("async save() + wait(): total", async_total_s);
    std::printf("  %-28s %10.1f%% %9s\n", "blocked / synchronous save", 100.0 * blocked / sync, "");
    std::printf("  %-28s %10.1f%% %9s\n", "blocked / async total", 100.0 * blocked / total, "");
    if (dd_mb_s > 0) {
      std::printf("  %-28s %10s %10.0f\n", "dd oflag=direct (the bound)", "", dd_mb_s);
      std::printf("  %-28s %10.1f%% %9s\n", "async write / dd bound", 100.0 * (mb / total) / dd_mb_s, "");
    } else {
      std::printf("# dd oflag=direct failed in %s: no bound to compare with\n", dir.c_str());
    }
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "checkpoint_perf: %s\n", e.what());
  return 2;
}
