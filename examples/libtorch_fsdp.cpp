// A decoder-only character-level transformer trained with gradsync::fully_shard (FSDP for LibTorch).
//
//   libtorch_fsdp                         4 ranks (threads), 4 blocks, d_model 128, 4 heads, context 64,
//                                         on /usr/share/common-licenses/GPL-3 (--text PATH), 8 epochs
//   libtorch_fsdp --ranks 2 --blocks 1 --d-model 32 --heads 2 --context 16 --steps 3
//   libtorch_fsdp --strategy full|grad-op|no-shard|hybrid [--shard-size S]
//   libtorch_fsdp --memory-budget BYTES   refuse to train where a rank would need more (default: halfway
//                                         between what FullShard needs and what a DDP replica needs)
//   mpirun -np 4 libtorch_fsdp --backend mpi    one rank per process (built with MPI)
//   libtorch_fsdp --save DIR              after every epoch and at --steps: each rank's shards and AdamW
//                                         state (DIR/rank-R-of-N.pt), and the full model (DIR/model.safetensors)
//   libtorch_fsdp --resume DIR            continue at the saved step, at the same number of ranks
//
// Each block is a gradsync::ShardedModule<Block> wrapped by fully_shard,
// then the root (embeddings, final norm, head), so between steps a rank
// holds 1/N of every unit, and AdamW, built on module->parameters(), steps
// on those shards and keeps 1/N of its moments. The text's windows of
// --context characters are shuffled each epoch from one seed; cut into
// batches, rank r takes batches r, r + N, ... . After training, every rank
// runs the same seeded sampling through the wrapped model (each forward
// gathers its units on every rank), and rank 0 prints the text.

#include <gradsync/gradsync.hpp>
#include <gradsync/checkpoint/crc32.hpp>
#include <gradsync/integration/torch.hpp>

#include "char_transformer.hpp"
#include "cli.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <random>
#include <numeric>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

/// --backend, --ranks, --epochs, --batch, --lr, --seed, --save and --resume
/// are every example's (example::RunArgs::read_run); the rest are this
/// program's.
struct Args : example::RunArgs {
  Args() : RunArgs{.epochs = 8, .batch = 16, .lr = 3e-3} {}
  std::string text = "/usr/share/common-licenses/GPL-3", strategy = "full", prompt = "This License";
  int shard_size = 0, sample = 240;
  example::TransformerShape shape;
  std::uint64_t steps = 0;  // 0: every epoch
  double clip = 1.0, budget = 0, temperature = 0.8;  // budget 0: the default
};

Args parse(int argc, char** argv) {
  Args a;
  for (example::ArgReader r(argc, argv); r.next();) {
    example::exit_on_help(r, [&] {
      const example::TransformerShape& s = a.shape;
      std::printf(
          "usage: libtorch_fsdp [options]\n%s"
          "  --seed S               seeds the initial weights, the windows' shuffle and the sampling (%llu)\n"
          "  --text PATH            the text to learn (%s)\n"
          "  --strategy full|grad-op|no-shard|hybrid   fully_shard's strategy (%s)\n"
          "  --shard-size S         ranks per shard group under hybrid (0: all)\n"
          "  --memory-budget BYTES  refuse to train where a rank would need more (default: halfway between\n"
          "                         what FullShard needs and what a DDP replica needs)\n"
          "  --steps N              stop after N steps (0: every epoch)\n"
          "  --blocks N, --d-model D, --heads H, --context C   the transformer (%lld, %lld, %lld, %lld)\n"
          "  --clip X               clip_grad_norm_ to X (%g)\n"
          "  --prompt TEXT          what the sampling after training starts from (%s)\n"
          "  --sample N             characters to sample (%d)\n"
          "  --temperature T        of the sampling (%g)\n"
          "Checkpoints (--save) are written after every epoch and at --steps.\n",
          a.run_help().c_str(), static_cast<unsigned long long>(a.seed), a.text.c_str(), a.strategy.c_str(),
          static_cast<long long>(s.blocks), static_cast<long long>(s.d_model), static_cast<long long>(s.heads),
          static_cast<long long>(s.context), a.clip, a.prompt.c_str(), a.sample, a.temperature);
    });
    if (a.read_run(r)) continue;
    const std::string& k = r.key();
    if (k == "--text") a.text = r.value();
    else if (k == "--strategy") a.strategy = r.value();
    else if (k == "--shard-size") a.shard_size = r.small();
    else if (k == "--memory-budget") a.budget = r.non_negative();
    else if (k == "--steps") a.steps = r.count();
    else if (k == "--blocks") a.shape.blocks = r.small();
    else if (k == "--d-model") a.shape.d_model = r.small();
    else if (k == "--heads") a.shape.heads = r.small();
    else if (k == "--context") a.shape.context = r.small();
    else if (k == "--clip") a.clip = r.non_negative();
    else if (k == "--prompt") a.prompt = r.value();
    else if (k == "--sample") a.sample = r.small();
    else if (k == "--temperature") a.temperature = r.non_negative();
    else {
      throw std::runtime_error("unknown option " + k +
                               " (expected --backend --ranks --text --strategy --shard-size --memory-budget --epochs "
                               "--steps --batch --blocks --d-model --heads --context --lr --clip --seed --prompt "
                               "--sample --temperature --save --resume)");
    }
  }
  if (a.epochs < 1 || a.batch < 1 || a.shape.blocks < 1 || a.shape.d_model < 1 || a.shape.heads < 1 ||
      a.shape.context < 2) {
    throw std::runtime_error("--epochs, --batch, --blocks, --d-model and --heads must be at least 1, --context 2");
  }
  if (a.shape.d_model % a.shape.heads != 0) throw std::runtime_error("--heads must divide --d-model");
  if (a.temperature <= 0) throw std::runtime_error("--temperature must be positive");
  // clip_grad_norm_ to 0 would zero every gradient.
  if (a.clip <= 0) throw std::runtime_error("--clip must be positive");
  if (a.shard_size != 0 && a.strategy != "hybrid") {
    throw std::runtime_error("--shard-size is for --strategy hybrid, not " + a.strategy);
  }
  if (a.prompt.empty()) throw std::runtime_error("--prompt must not be empty");
  const std::set<std::string> strategies{"full", "grad-op", "no-shard", "hybrid"};
  if (!strategies.contains(a.strategy)) {
    throw std::runtime_error("unknown --strategy '" + a.strategy + "' (expected full, grad-op, no-shard or hybrid)");
  }
  // The backend's checks are the other examples' (examples/cli.hpp).
  a.check("libtorch_fsdp");
  return a;
}

/// The text as character ids: the vocabulary is its distinct bytes, sorted.
/// The last tenth is held out to score the model.
struct Corpus {
  std::string vocab;
  torch::Tensor train, held_out;  // 1-D, int64
  /// "N bytes, CRC-32 X" of the whole text, which a checkpoint records.
  std::string checksum;

  explicit Corpus(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("--text " + path + ": cannot open it");
    const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    gradsync::checkpoint::Crc32 crc;
    crc.update(std::as_bytes(std::span<const char>(text)));
    checksum = std::to_string(text.size()) + " bytes, CRC-32 " + gradsync::checkpoint::crc32_hex(crc.value());
    const std::set<char> chars(text.begin(), text.end());
    vocab.assign(chars.begin(), chars.end());
    const torch::Tensor ids = encode(text);
    const std::int64_t cut = ids.numel() * 9 / 10;
    train = ids.narrow(0, 0, cut);
    held_out = ids.narrow(0, cut, ids.numel() - cut);
  }
  torch::Tensor encode(const std::string& s) const {
    std::vector<std::int64_t> ids;
    for (char c : s) {
      const auto at = vocab.find(c);
      if (at == std::string::npos) throw std::runtime_error(std::string("the text has no character '") + c + "'");
      ids.push_back(static_cast<std::int64_t>(at));
    }
    return torch::tensor(ids, torch::kLong);
  }
};

/// Inputs and next-character targets of the windows `which` (their
/// numbers) of `ids`, each `context` long: batch x context each.
std::array<torch::Tensor, 2> windows(const torch::Tensor& ids, const std::vector<std::int64_t>& which,
                                     std::int64_t context) {
  std::vector<torch::Tensor> x, y;
  for (std::int64_t w : which) {
    x.push_back(ids.narrow(0, w * context, context));
    y.push_back(ids.narrow(0, w * context + 1, context));
  }
  return {torch::stack(x), torch::stack(y)};
}

gradsync::FullyShardOptions shard_options(const Args& a, int world) {
  gradsync::FullyShardOptions o;
  o.collective.deterministic = true;  // sums in rank order: a resumed run repeats an uninterrupted one
  if (a.strategy == "grad-op") o.strategy = gradsync::ShardingStrategy::ShardGradOp;
  if (a.strategy == "no-shard") o.strategy = gradsync::ShardingStrategy::NoShard;
  if (a.strategy == "hybrid") {
    o.strategy = gradsync::ShardingStrategy::HybridShard;
    // Default: pairs of ranks share a copy, where N is even and above 2.
    o.shard_size = a.shard_size ? a.shard_size : (world > 2 && world % 2 == 0 ? 2 : world);
  }
  return o;
}

/// Ranks among which a unit is split: its padded size is a multiple of it.
int shard_group(const gradsync::FullyShardOptions& o, int world) {
  if (o.strategy == gradsync::ShardingStrategy::NoShard) return 1;
  if (o.strategy == gradsync::ShardingStrategy::HybridShard && o.shard_size > 0) return o.shard_size;
  return world;
}

std::int64_t numel(const std::vector<torch::Tensor>& ts) {
  std::int64_t n = 0;
  for (const auto& t : ts) n += t.numel();
  return n;
}

template <class Comm>
double sum_over_ranks(Comm& comm, std::vector<double>& v, bool max = false) {
  if (max) gradsync::AllReduce<>{{.deterministic = true}}(comm, v, gradsync::Max{});
  else gradsync::AllReduce<>{{.deterministic = true}}(comm, v, gradsync::Sum{});
  return v[0];
}

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

std::string rank_file(const std::string& dir, int rank, int world) {
  return (std::filesystem::path(dir) / ("rank-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".pt"))
      .string();
}

/// The mean cross-entropy of the held-out windows (each rank scores its
/// share, the same count on every rank: every rank makes the same forward calls).
template <class Comm>
double held_out_loss(Comm& comm, gradsync::ShardedModule<example::CharTransformer>& model, const Corpus& corpus,
                     std::int64_t context) {
  torch::NoGradGuard no_grad;
  const std::int64_t n = comm.size(), per_rank = (corpus.held_out.numel() - 1) / context / n;
  if (per_rank < 1) throw std::runtime_error("the held-out tenth of the text is too short for --context and N");
  std::vector<std::int64_t> mine;
  for (std::int64_t i = 0; i < per_rank; ++i) mine.push_back(i * n + comm.rank());
  const auto [x, y] = windows(corpus.held_out, mine, context);
  const torch::Tensor logits = model(x).reshape({-1, static_cast<std::int64_t>(corpus.vocab.size())});
  std::vector<double> sums{
      torch::nn::functional::cross_entropy(logits, y.reshape(-1),
                                           torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
          .item<double>(),
      static_cast<double>(y.numel())};
  sum_over_ranks(comm, sums);
  return sums[0] / sums[1];
}

template <class Comm>
double train(Comm& comm, const Corpus& corpus, const Args& a) {
  torch::set_num_threads(1);
  const int n = comm.size(), rank = comm.rank();
  const bool printer = rank == 0;
  example::TransformerShape shape = a.shape;
  shape.vocab = static_cast<std::int64_t>(corpus.vocab.size());
  gradsync::ShardedModule<example::CharTransformer> model = [&] {
    // The process's default generator is shared by the rank threads: seed
    // and draw under one lock, so rank 0's weights (which fully_shard
    // broadcasts) depend on the seed alone.
    static std::mutex generator;
    const std::lock_guard<std::mutex> lock(generator);
    torch::manual_seed(a.seed);
    return gradsync::ShardedModule<example::CharTransformer>(shape);
  }();
  // The plan's sizes are counted before wrapping: afterwards a parameter is this rank's piece.
  const std::int64_t total = numel(model->parameters());
  std::vector<std::string> names;
  std::vector<std::int64_t> sizes;
  for (std::size_t i = 0; i < model->blocks.size(); ++i) {
    names.push_back("block" + std::to_string(i));
    sizes.push_back(numel(model->blocks[i]->parameters()));
  }
  names.push_back("root (tok, pos, ln_f, head)");
  sizes.push_back(total - std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0}));

  const gradsync::FullyShardOptions options = shard_options(a, n);
  for (auto& block : model->blocks) gradsync::fully_shard(block, comm, options);  // innermost first
  gradsync::fully_shard(model, comm, options);                                     // then the root

  // Per rank: parameters and gradients (fully_shard_persistent_bytes) and
  // AdamW's two moments on the same pieces; each unit's chunk is ⌈P/g⌉
  // elements over its g ranks (P under NoShard).
  const int group = shard_group(options, n);
  const std::size_t elt = sizeof(float);
  std::size_t formula = 0, measured_units = 0;
  std::vector<std::size_t> unit_bytes;
  std::vector<std::int64_t> owned;  // elements of this rank's pieces, padding left out
  for (auto& block : model->blocks) {
    unit_bytes.push_back(gradsync::fully_shard_persistent_bytes(block));
    owned.push_back(numel(block->parameters()));
  }
  owned.push_back(numel(model->parameters()) - std::accumulate(owned.begin(), owned.end(), std::int64_t{0}));
  const std::size_t measured = gradsync::fully_shard_persistent_bytes(model);
  for (std::size_t b : unit_bytes) measured_units += b;
  unit_bytes.push_back(measured - measured_units);
  std::vector<double> extremes{static_cast<double>(measured), -static_cast<double>(measured)};
  sum_over_ranks(comm, extremes, /*max=*/true);
  std::size_t chunks = 0;
  for (std::int64_t p : sizes) chunks += (static_cast<std::size_t>(p) + std::size_t(group) - 1) / std::size_t(group);
  formula = 2 * chunks * elt;
  const double adam = static_cast<double>(2 * chunks * elt), need = extremes[0] + adam;
  const double ddp = 4.0 * static_cast<double>(total) * elt;  // parameters, gradients, two moments, everywhere
  // Default budget: halfway between FullShard's need at this N and a replica's.
  const std::size_t full_chunks = [&] {
    std::size_t c = 0;
    for (std::int64_t p : sizes) c += (static_cast<std::size_t>(p) + std::size_t(n) - 1) / std::size_t(n);
    return c;
  }();
  const double budget = a.budget > 0 ? a.budget : (4.0 * double(full_chunks * elt) + ddp) / 2;

  std::int64_t steps_per_epoch =
      (corpus.train.numel() - 1) / shape.context / a.batch / n;  // whole batches, the same count on every rank
  if (steps_per_epoch < 1) throw std::runtime_error("the text is too short for one batch per rank");
  const std::uint64_t all_steps = std::uint64_t(a.epochs) * std::uint64_t(steps_per_epoch);
  // --steps stops within --epochs; past them it would train epochs no one asked for.
  if (a.steps > all_steps) {
    throw std::runtime_error("--steps " + std::to_string(a.steps) + " is past the end of --epochs " +
                             std::to_string(a.epochs) + " (" + std::to_string(all_steps) +
                             " steps); give more --epochs");
  }
  const std::uint64_t last = a.steps ? a.steps : all_steps;

  if (printer) {
    std::printf("character transformer: %lld blocks, d_model %lld, %lld heads, context %lld, vocabulary %zu "
                "(%lld parameters); %s: %lld training / %lld held-out characters\n",
                (long long)shape.blocks, (long long)shape.d_model, (long long)shape.heads, (long long)shape.context,
                corpus.vocab.size(), (long long)total, a.text.c_str(), (long long)corpus.train.numel(),
                (long long)corpus.held_out.numel());
    std::printf("fully_shard, %s over %d ranks (%s), shards of %d ranks; rank 0's units:\n",
                gradsync::name(options.strategy), n, a.backend.c_str(), group);
    std::printf("  %-28s %10s %10s %12s %12s\n", "unit", "params", "padded", "chunk/rank", "rank 0 owns");
    for (std::size_t u = 0; u < names.size(); ++u) {
      const auto p = static_cast<std::size_t>(sizes[u]), g = std::size_t(group), c = (p + g - 1) / g;
      std::printf("  %-28s %10zu %10zu %12zu %12zu\n", names[u].c_str(), p, c * g, unit_bytes[u] / (2 * elt),
                  static_cast<std::size_t>(owned[u]));
    }
    std::printf("memory per rank: parameters + gradients %.3f MiB measured (fully_shard_persistent_bytes, largest "
                "rank; formula 2 x 4 B x sum of chunks = %.3f MiB), + AdamW moments %.3f MiB = %.3f MiB; "
                "a DDP replica needs %.3f MiB (16 B x %lld); budget %.3f MiB\n",
                mib(extremes[0]), mib(double(formula)), mib(adam), mib(need), mib(ddp), (long long)total, mib(budget));
    std::printf("batch %d per rank, %lld per step over the ranks, %lld steps per epoch; AdamW lr %g, gradients "
                "clipped to norm %g\n",
                a.batch, (long long)a.batch * n, (long long)steps_per_epoch, a.lr, a.clip);
    std::fflush(stdout);
  }
  if (extremes[0] != -extremes[1]) throw std::runtime_error("the ranks hold different amounts");
  if (need > budget) {
    throw std::runtime_error(std::string(gradsync::name(options.strategy)) + " needs " + std::to_string(mib(need)) +
                             " MiB per rank, over the budget of " + std::to_string(mib(budget)) +
                             " MiB: give more ranks, another --strategy or a larger --memory-budget");
  }
  if (printer) {
    std::printf("%s fits the budget; a DDP replica %s\n", gradsync::name(options.strategy),
                ddp > budget ? "would not" : "would too, at this budget");
  }

  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(a.lr).weight_decay(0.01));
  std::uint64_t step = 0;
  // What a checkpoint records of its run and a resume must match: the text,
  // the model (the head count changes no shape), and the batch and seed
  // that order the windows of an epoch.
  const std::vector<std::pair<std::string, std::string>> record{
      {"text", corpus.checksum},
      {"model", "blocks " + std::to_string(shape.blocks) + ", d_model " + std::to_string(shape.d_model) + ", heads " +
                    std::to_string(shape.heads) + ", context " + std::to_string(shape.context)},
      {"batch", std::to_string(a.batch)},
      {"seed", std::to_string(a.seed)}};
  if (!a.resume.empty()) {
    // Every rank checks every file first, so all agree before any reads.
    for (int r = 0; r < n; ++r) {
      if (!std::filesystem::is_regular_file(rank_file(a.resume, r, n))) {
        throw std::runtime_error("--resume " + a.resume + ": no " + rank_file(a.resume, r, n) +
                                 " (saved by --save at " + std::to_string(n) + " ranks?)");
      }
    }
    torch::serialize::InputArchive in, params, optimizer;
    in.load_from(rank_file(a.resume, rank, n));
    // Each rank renames its own file: a save cut short between two ranks'
    // renames leaves files of two saves, which the save's id tells apart.
    // The ranks compare ids and steps first, so that all agree on what
    // follows.
    torch::Tensor saved_step, saved_id;
    in.read("step", saved_step);
    step = static_cast<std::uint64_t>(saved_step.item<std::int64_t>());
    if (!in.try_read("save_id", saved_id)) saved_id = torch::tensor(std::int64_t{0});
    std::array<std::int64_t, 2> mine{saved_id.item<std::int64_t>(), static_cast<std::int64_t>(step)};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(n));
    gradsync::AllGather<>{}(comm, std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
    for (int r = 0; r < n; ++r) {
      if (all[2 * std::size_t(r)] != all[0] || all[2 * std::size_t(r) + 1] != all[1]) {
        throw std::runtime_error("--resume " + a.resume + ": " + rank_file(a.resume, r, n) +
                                 " is of another save (step " + std::to_string(all[2 * std::size_t(r) + 1]) +
                                 ") than " + rank_file(a.resume, 0, n) + " (step " + std::to_string(all[1]) +
                                 "): a save cut short between ranks; resume from an earlier checkpoint");
      }
    }
    // One save's files record one run. (A checkpoint that records none
    // predates the record: accepted, as the other examples accept it.)
    for (const auto& [key, value] : record) {
      c10::IValue saved;
      if (in.try_read(key, saved) && saved.isString() && saved.toStringRef() != value) {
        throw std::runtime_error("--resume " + a.resume + ": the checkpoint's run had " + key + " '" +
                                 saved.toStringRef() + "', this one '" + value +
                                 "'; resume with the same --text, model, --batch and --seed");
      }
    }
    in.read("params", params);
    // Copied into the pieces: Module::load would point them at the file's
    // storage, away from the unit's shard they are views of.
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) {
      torch::Tensor t;
      params.read(p.key(), t);
      if (!t.sizes().equals(p.value().sizes())) {
        throw std::runtime_error("--resume: " + p.key() + " has another shape there (another model or strategy?)");
      }
      p.value().copy_(t);
    }
    in.read("optimizer", optimizer);
    opt.load(optimizer);
    if (printer) std::printf("resumed from %s at step %llu\n", a.resume.c_str(), (unsigned long long)step);
  }
  auto save = [&] {
    if (a.save.empty()) return;
    std::filesystem::create_directories(a.save);
    // One id per save, rank 0's, on every rank's file.
    std::int64_t id = static_cast<std::int64_t>(std::random_device{}() >> 1) << 31 ^ std::random_device{}();
    gradsync::Broadcast<>{}(comm, std::span<std::int64_t>(&id, 1), 0);
    torch::serialize::OutputArchive out, params, optimizer;
    out.write("step", torch::tensor(static_cast<std::int64_t>(step)));
    out.write("save_id", torch::tensor(id));
    for (const auto& [key, value] : record) out.write(key, c10::IValue(value));
    for (const auto& p : model->named_parameters()) params.write(p.key(), p.value());
    out.write("params", params);
    opt.save(optimizer);
    out.write("optimizer", optimizer);
    const std::string file = rank_file(a.save, rank, n);
    out.save_to(file + ".tmp");
    std::filesystem::rename(file + ".tmp", file);  // whole, or the previous one
    gradsync::save_full_state_dict(model, comm, std::filesystem::path(a.save) / "model.safetensors");
    if (printer) std::printf("saved %s at step %llu\n", a.save.c_str(), (unsigned long long)step);
  };

  if (step >= last && printer)
    std::printf("nothing to train: the checkpoint is at step %llu\n", (unsigned long long)step);
  const std::int64_t per_epoch_windows = steps_per_epoch * a.batch * n;
  const std::int64_t all_windows = (corpus.train.numel() - 1) / shape.context;
  while (step < last) {
    const std::int64_t epoch = static_cast<std::int64_t>(step) / steps_per_epoch;
    const std::int64_t first = static_cast<std::int64_t>(step) % steps_per_epoch;
    // One order per epoch, the same on every rank.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(a.seed * 1000003 + std::uint64_t(epoch));
    const torch::Tensor order = torch::randperm(all_windows, gen, torch::kLong).narrow(0, 0, per_epoch_windows);
    const auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::int64_t s = first;
    model->train();
    for (; s < steps_per_epoch && step < last; ++s, ++step) {
      const std::int64_t b = s * n + rank;  // this rank's batch of the step
      const torch::Tensor ids = order.narrow(0, b * a.batch, a.batch);
      const auto [x, y] = windows(corpus.train, std::vector<std::int64_t>(ids.data_ptr<std::int64_t>(),
                                                                          ids.data_ptr<std::int64_t>() + a.batch),
                                  shape.context);
      opt.zero_grad();
      const torch::Tensor logits = model(x);
      torch::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, shape.vocab}), y.reshape(-1));
      loss.backward();  // returns with this rank's shard of the averaged gradient
      gradsync::clip_grad_norm_(model, comm, a.clip);
      opt.step();
      loss_sum += loss.item<double>();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<double> sums{loss_sum};
    sum_over_ranks(comm, sums);
    model->eval();
    const double held = held_out_loss(comm, model, corpus, shape.context);
    if (printer) {
      std::printf("epoch %lld  train loss %.4f  held-out loss %.4f  (steps %lld-%lld of %lld, %.1f s)\n",
                  (long long)epoch + 1, sums[0] / double(n) / double(s - first), held, (long long)first + 1,
                  (long long)s, (long long)steps_per_epoch, seconds);
      std::fflush(stdout);
    }
    save();
  }
  model->eval();
  const double final_loss = held_out_loss(comm, model, corpus, shape.context);

  // Sampling: every rank draws alike from its own seeded generator, so every
  // rank runs the same forwards (each gathers every unit on every rank).
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(a.seed);
  std::vector<std::int64_t> ids;
  const torch::Tensor prompt = corpus.encode(a.prompt);
  ids.assign(prompt.data_ptr<std::int64_t>(), prompt.data_ptr<std::int64_t>() + prompt.numel());
  std::string text = a.prompt;
  for (int i = 0; i < a.sample; ++i) {
    const std::size_t from = ids.size() > std::size_t(shape.context) ? ids.size() - std::size_t(shape.context) : 0;
    const torch::Tensor x = torch::tensor(std::vector<std::int64_t>(ids.begin() + std::ptrdiff_t(from), ids.end()),
                                          torch::kLong)
                                .unsqueeze(0);
    const torch::Tensor logits = model(x)[0][-1] / a.temperature;
    const std::int64_t next = torch::multinomial(logits.softmax(-1), 1, false, gen).item<std::int64_t>();
    ids.push_back(next);
    text += corpus.vocab[static_cast<std::size_t>(next)];
  }
  if (printer) {
    std::printf("sample (seed %llu, temperature %g):\n%s\n", (unsigned long long)a.seed, a.temperature, text.c_str());
    std::printf("final held-out loss %.6f after %llu steps\n", final_loss, (unsigned long long)step);
    std::fflush(stdout);
  }
  return final_loss;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  const Corpus corpus(args.text);
  // The prompt is read after training: a character the text lacks is refused now.
  try {
    corpus.encode(args.prompt);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string("--prompt: ") + e.what());
  }
  example::run_on_backend(args.backend, args.ranks, [&](auto& comm) { return train(comm, corpus, args); });
  return 0;
} catch (const c10::Error& e) {
  return example::exit_error("libtorch_fsdp", e.what_without_backtrace());
} catch (const std::exception& e) {
  return example::exit_error("libtorch_fsdp", e.what());
}
