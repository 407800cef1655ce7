// Times opening a safetensors file whose header declares many tensors: the
// JSON parse alone and the whole SafetensorsReader (read, parse, validate),
// for a file gradsync wrote and for a hostile header of one flat object with
// as many keys, whose duplicate-key check must stay linear.
//
//   safetensors_header_perf [--tensors 100000] [--repeats 5] [--dir DIR]
//
// Each figure is the median of --repeats runs, wall-clock and this process's
// CPU time (which other work on a busy machine inflates less); the file is in
// the page cache.

#include <gradsync/checkpoint/json.hpp>
#include <gradsync/checkpoint/safetensors_reader.hpp>
#include <gradsync/checkpoint/safetensors_writer.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace ck = gradsync::checkpoint;

double cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Median wall and CPU seconds of `repeats` runs of `f`; `setup` runs untimed before each.
struct Timing {
  double wall = 0, cpu = 0;
};
Timing time_of(int repeats, const std::function<void()>& setup, const std::function<void()>& f) {
  std::vector<double> wall, cpu;
  for (int r = 0; r < repeats; ++r) {
    setup();
    const double c0 = cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    cpu.push_back(cpu_seconds() - c0);
  }
  return {median(std::move(wall)), median(std::move(cpu))};
}

/// Parses a copy of `text` made beforehand, as the reader parses the buffer it read the header into.
Timing parse_time(const std::string& text, int repeats, std::size_t& sink) {
  std::string copy;
  return time_of(repeats, [&] { copy = text; }, [&] { sink += ck::detail::parse_json(std::move(copy)).root().size(); });
}

std::string header_of(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  char len_le[8];
  if (!in.read(len_le, 8)) throw std::runtime_error("cannot read " + p.string());
  std::uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = len << 8 | static_cast<unsigned char>(len_le[i]);
  std::string text(len, '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(len))) throw std::runtime_error("cannot read " + p.string());
  return text;
}

}  // namespace

int main(int argc, char** argv) try {
  std::size_t tensors = 100000;
  int repeats = 5;
  std::filesystem::path dir = std::filesystem::temp_directory_path();
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw std::runtime_error(k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--tensors") tensors = std::stoull(v);
    else if (k == "--repeats") repeats = std::stoi(v);
    else if (k == "--dir") dir = v;
    else throw std::runtime_error("unknown option " + k + " (expected --tensors --repeats --dir)");
  }
  if (tensors < 1 || repeats < 1) throw std::runtime_error("--tensors and --repeats must be at least 1");
  // A directory of its own inside --dir, the only thing removed at the end.
  const std::filesystem::path work = dir / ("gradsync-safetensors-header-perf-" + std::to_string(::getpid()));
  std::filesystem::create_directories(work);
  const auto path = work / "many.safetensors";

  // Names and shapes like a transformer's; 4 elements each keeps the data small.
  std::vector<ck::TensorInfo> specs;
  for (std::size_t i = 0; i < tensors; ++i)
    specs.push_back({"model.layers." + std::to_string(i / 8) + ".block" + std::to_string(i % 8) + ".weight",
                     ck::TensorDtype::F32, {2, 2}});
  {
    ck::SafetensorsWriter w(path, specs);
    const std::byte zeros[16]{};
    for (const auto& s : specs) w.write(s.name, zeros);
    w.commit();
  }
  const std::string header = header_of(path);
  std::string hostile = "{";
  for (std::size_t i = 0; i < tensors; ++i) hostile += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":0";
  hostile += '}';

  std::size_t sink = 0;
  const Timing parse_t = parse_time(header, repeats, sink);
  const Timing open_t = time_of(repeats, [] {}, [&] { sink += ck::SafetensorsReader(path).tensors().size(); });
  const Timing flat_t = parse_time(hostile, repeats, sink);
  std::filesystem::remove_all(work);
  if (sink != std::size_t(repeats) * (tensors + 1 + tensors + tensors))
    throw std::runtime_error("parsed a different number of members than written");

  std::printf("# safetensors_header_perf: %zu tensors, median of %d\n", tensors, repeats);
  std::printf("# %-44s %8s %10s %10s %10s\n", "what", "MB", "wall ms", "CPU ms", "MB/s");
  auto row = [](const char* what, std::size_t bytes, Timing t) {
    std::printf("  %-44s %8.2f %10.2f %10.2f %10.0f\n", what, double(bytes) / 1e6, t.wall * 1e3, t.cpu * 1e3,
                double(bytes) / 1e6 / t.wall);
  };
  row("parse_json (gradsync's header)", header.size(), parse_t);
  row("SafetensorsReader (read, parse, validate)", header.size(), open_t);
  row("parse_json (one object, as many keys)", hostile.size(), flat_t);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "safetensors_header_perf: %s\n", e.what());
  return 2;
}
