#pragma once
/// \file The *_perf tools' command line: one Config, one parser and one usage
/// text, shaped by the tool's descriptor (see driver.hpp).

#include <gradsync/collectives.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace bench {

#ifdef GRADSYNC_BENCH_MPI
inline constexpr std::string_view backend_name = "mpi";
#else
inline constexpr std::string_view backend_name = "threads";
#endif

/// Seconds per size and placement that -n 0 aims for.
inline constexpr double time_budget_s = 0.2;

struct Config {
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{64} << 20;
  std::size_t factor = 2;
  int iters = 0;
  int warmup = 5;
  int repeats = 5;
  bool check = true;
  std::string type = "float";
  std::string op = "sum";
  int ranks = 2;
  std::vector<std::string> algorithms{"auto"};
  std::string json_path;
  bool ranks_given = false;
  int root = 0;  // rooted collectives only (--root)
  bool calibrate = false;
  bool model = false;
  std::vector<int> model_ranks{8, 64, 512, 4096};
  std::string preset;
  gradsync::CostModel link;  // --model's figures; preset, then flags
  bool link_given = false;
};

/// Presets for --model, from published figures:
/// - nvlink: NVLink 4 (H100 SXM), 18 links x 25 GB/s = 450 GB/s per direction
///   per GPU (NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022);
///   NCCL's small-message all-reduce latency within an NVLink node is a few
///   microseconds (NCCL tuning model, src/graph/tuning.cc: ~0.6-5 us per step
///   for LL/Simple), so alpha = 3 us; gamma from HBM3 at 3.35 TB/s (reduce
///   reads two bytes and writes one: ~1e-12 s/B).
/// - infiniband: NDR 400 Gb/s = 50 GB/s per port per direction (NVIDIA
///   ConnectX-7 / Quantum-2 datasheets); MPI point-to-point latency over IB
///   is about 1-2 us (OSU micro-benchmarks, osu_latency), so alpha = 1.5 us;
///   gamma = host reduce at ~10 GB/s.
inline gradsync::CostModel preset_model(const std::string& name) {
  gradsync::CostModel m;
  if (name == "nvlink") {
    m.alpha = 3e-6;
    m.beta = 1.0 / 450e9;
    m.gamma = 1e-12;
  } else {
    m.alpha = 1.5e-6;
    m.beta = 1.0 / 50e9;
    m.gamma = 1e-10;
  }
  m.native_alpha = 0;
  return m;
}

inline const std::vector<std::string> type_names(std::begin(gradsync::data_type_names), std::end(gradsync::data_type_names));
inline const std::vector<std::string> op_names{"sum", "avg", "min", "max", "prod"};
inline const std::vector<std::string> all_algorithm_names{"ring", "tree", "rhd", "native", "auto"};

/// The usage text: all_reduce_perf's, with the lines that differ per tool
/// (size convention, -o, --root, --calibrate/--model) taken from Desc.
template <class Desc>
std::string usage_text() {
  const std::string tool(Desc::name);
  std::string u = "usage: " + tool + " [options]\n";
  u += Desc::usage_note;
  u += "  -b BYTES   smallest size (default 8); K, M, G suffixes are powers of 1024\n"
       "  -e BYTES   largest size (default 64M)\n"
       "  -f FACTOR  size multiplication factor, an integer >= 2 (default 2)\n"
       "  -n ITERS   timed calls per repeat (default 0: auto, about 0.2 s per size\n"
       "             and placement over all repeats, at least 3, at most 100000)\n"
       "  -w ITERS   warm-up calls per size and placement (default 5)\n"
       "  -r REPEATS repeats; the reported time is their median (default 5)\n"
       "  -c 0|1     check every rank's result against the exact one (default 1)\n"
       "  -d TYPE    float, double, int32, int64, bfloat16 or float16 (default float)\n";
  if (Desc::reduces) {
    u += "  -o OP      sum, avg, min, max or prod (default sum)\n";
  } else {
    u += "  -o OP      accepted and ignored: nothing is reduced (redop shows none)\n";
  }
  if (Desc::rooted) {
    u += "  --root R   the root rank, in [0, N) (default 0); nccl-tests spells it -r,\n"
         "             which here is repeats\n";
  }
  u += "  -t RANKS   in-process ranks (default 2; threads backend only)\n"
       "  --backend B  threads (" + tool + ") or mpi (" + tool + "_mpi, run under\n"
       "             mpirun; the world size is mpirun's -np). Default: the one built in\n"
       "  --algo A   ring, tree, rhd, native, auto or all (default auto)\n"
       "  -J FILE    also write every figure, with p50 and p99 over repeats, as JSON\n";
  if (Desc::model_modes) {
    u += "  --calibrate  fit the cost model on this backend and world size (>= 2 ranks)\n"
         "             and print GRADSYNC_COST_MODEL=... in the format Auto reads\n"
         "  --model    predict only, no communication: time per algorithm per size\n"
         "             (-b -e -f) and the winner, for each world size in --ranks\n"
         "  --ranks LIST       comma-separated world sizes for --model (default 8,64,512,4096)\n"
         "  --alpha S --beta S --gamma S --native-alpha S   link figures for --model\n"
         "             (seconds per message, per byte moved, per byte reduced, per Native\n"
         "             synchronisation; native-alpha 0 = no Native)\n"
         "  --preset P nvlink or infiniband: published link figures for --model\n";
  } else {
    u += "  (--calibrate and --model are all_reduce_perf's: the model is fitted on all-reduce)\n";
  }
  u += "  -h         show this text\n"
       "Exits with status 1 if any result was wrong, 2 on a usage or run error.\n";
  return u;
}

[[noreturn]] inline void usage_error(const std::string& what) {
  throw std::invalid_argument(what + " (run with -h for usage)");
}

inline long long parse_int(std::string_view flag, const std::string& text, long long lo, long long hi) {
  std::size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    usage_error(std::string(flag) + " expects an integer, got '" + text + "'");
  }
  if (used != text.size() || v < lo || v > hi) {
    usage_error(std::string(flag) + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                "], got '" + text + "'");
  }
  return v;
}

/// "64M" -> 67108864: an integer with an optional binary K, M or G suffix.
inline std::size_t parse_bytes(std::string_view flag, std::string text) {
  int shift = 0;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K': case 'k': shift = 10; break;
      case 'M': case 'm': shift = 20; break;
      case 'G': case 'g': shift = 30; break;
      default: break;
    }
    if (shift) text.pop_back();
  }
  const long long v = parse_int(flag, text, 0, (1LL << 40) >> shift);
  return static_cast<std::size_t>(v) << shift;
}

inline std::string pick(std::string_view flag, const std::string& value, const std::vector<std::string>& allowed) {
  if (std::find(allowed.begin(), allowed.end(), value) == allowed.end()) {
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    usage_error(std::string(flag) + " expects one of " + list + ", got '" + value + "'");
  }
  return value;
}

template <class Desc>
Config parse_args(int argc, char** argv) {
  const std::string tool(Desc::name);
  Config cfg;
  auto model_only = [&](const std::string& flag) {
    if (!Desc::model_modes) {
      usage_error(flag + " is all_reduce_perf's only: the cost model is fitted and explored on all-reduce");
    }
  };
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::fputs(usage_text<Desc>().c_str(), stdout);
      std::exit(0);
    }
    if (flag == "--calibrate") {
      model_only(flag);
      cfg.calibrate = true;
      continue;
    }
    if (flag == "--model") {
      model_only(flag);
      cfg.model = true;
      continue;
    }
    if (i + 1 >= argc) usage_error("unknown option or missing value: " + flag);
    const std::string value = argv[++i];
    if (flag == "-b") cfg.min_bytes = parse_bytes(flag, value);
    else if (flag == "-e") cfg.max_bytes = parse_bytes(flag, value);
    else if (flag == "-f") cfg.factor = static_cast<std::size_t>(parse_int(flag, value, 2, 1 << 20));
    else if (flag == "-n") cfg.iters = static_cast<int>(parse_int(flag, value, 0, 1 << 30));
    else if (flag == "-w") cfg.warmup = static_cast<int>(parse_int(flag, value, 0, 1 << 30));
    else if (flag == "-r") cfg.repeats = static_cast<int>(parse_int(flag, value, 1, 1000));
    else if (flag == "-c") cfg.check = parse_int(flag, value, 0, 1) != 0;
    else if (flag == "-d") cfg.type = pick(flag, value, type_names);
    else if (flag == "-o") cfg.op = pick(flag, value, op_names);
    else if (flag == "-t") {
      cfg.ranks = static_cast<int>(parse_int(flag, value, 1, 1024));
      cfg.ranks_given = true;
    } else if (flag == "--root") {
      if (!Desc::rooted) usage_error("--root is for rooted collectives (broadcast_perf); " + tool + " has no root");
      cfg.root = static_cast<int>(parse_int(flag, value, 0, 1 << 24));
    } else if (flag == "--backend") {
      const std::string b = pick(flag, value, {"threads", "mpi", "nccl"});
      if (b != backend_name) {
        // Only all-reduce has an NCCL build (nccl_all_reduce_perf).
        const std::string nccl = Desc::collective == gradsync::Collective::all_reduce ? "; use nccl_" + tool
                                                                                      : "; there is no NCCL build of " + tool;
        usage_error("--backend " + b + " is not built into this binary (it runs " + std::string(backend_name) +
                    (b == "mpi" ? "; use " + tool + "_mpi under mpirun" : b == "threads" ? "; use " + tool : nccl) +
                    ")");
      }
    } else if (flag == "--ranks") {
      model_only(flag);
      cfg.model_ranks.clear();
      std::size_t pos = 0;
      while (pos <= value.size()) {
        const std::size_t comma = std::min(value.find(',', pos), value.size());
        cfg.model_ranks.push_back(static_cast<int>(parse_int(flag, value.substr(pos, comma - pos), 1, 1 << 24)));
        pos = comma + 1;
      }
    } else if (flag == "--preset") {
      model_only(flag);
      cfg.preset = pick(flag, value, {"nvlink", "infiniband"});
    } else if (flag == "--alpha" || flag == "--beta" || flag == "--gamma" || flag == "--native-alpha") {
      model_only(flag);
      cfg.link = gradsync::detail::parse_cost_model(flag.substr(2) == "native-alpha" ? "native_alpha=" + value
                                                                                       : flag.substr(2) + "=" + value,
                                                    cfg.link);
      cfg.link_given = true;
    }
    else if (flag == "-J") cfg.json_path = value;
    else if (flag == "--algo") {
      std::vector<std::string> choices = all_algorithm_names;
      choices.push_back("all");
      const std::string a = pick(flag, value, choices);
      cfg.algorithms = a == "all" ? all_algorithm_names : std::vector<std::string>{a};
    } else {
      usage_error("unknown option " + flag);
    }
  }
  if (cfg.min_bytes > cfg.max_bytes) usage_error("-b must not exceed -e");
  if (cfg.model && !cfg.preset.empty()) {
    // The preset first, then any figure given explicitly on top of it.
    gradsync::CostModel m = preset_model(cfg.preset);
    const gradsync::CostModel defaults;
    if (cfg.link.alpha != defaults.alpha) m.alpha = cfg.link.alpha;
    if (cfg.link.beta != defaults.beta) m.beta = cfg.link.beta;
    if (cfg.link.gamma != defaults.gamma) m.gamma = cfg.link.gamma;
    if (cfg.link.native_alpha != defaults.native_alpha) m.native_alpha = cfg.link.native_alpha;
    cfg.link = m;
  } else if (cfg.model && !cfg.link_given) {
    usage_error("--model needs --preset or --alpha/--beta/--gamma");
  }
#ifdef GRADSYNC_BENCH_MPI
  if (cfg.ranks_given) usage_error("-t is for the threads backend; under mpi the world size is mpirun's -np");
#endif
  return cfg;
}

/// The sizes swept: min, min*f, ... up to max.
inline std::vector<std::size_t> sizes(const Config& cfg) {
  std::vector<std::size_t> out;
  for (std::size_t b = cfg.min_bytes; b <= cfg.max_bytes; b = std::max<std::size_t>(b * cfg.factor, 1)) {
    out.push_back(b);
  }
  return out;
}

}  // namespace bench
