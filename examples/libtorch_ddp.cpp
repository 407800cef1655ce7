// Data-parallel training of a LibTorch module with gradsync::DistributedDataParallel.
//
//   libtorch_ddp                          4 ranks (threads); Fashion-MNIST where installed
//                                         (Debian: dataset-fashion-mnist), else built-in synthetic data
//   libtorch_ddp --dataset synthetic      the built-in data (--dataset fashion-mnist: Debian's, or an error)
//   libtorch_ddp --data DIR               MNIST-layout IDX files in DIR, plain or .gz (--mnist DIR too)
//   libtorch_ddp --ranks 2 --epochs 3
//   mpirun -np 4 libtorch_ddp --backend mpi    one rank per process (built with MPI)
//   libtorch_ddp --save DIR               checkpoint to DIR/checkpoint.pt after every epoch
//   libtorch_ddp --resume DIR             continue from it at the next epoch: weights, momentum, sampler
//   libtorch_ddp --metrics m.jsonl --metrics-every 50    a JSON line per epoch and per 50 steps (rank 0)
//   tools/plot-training m.jsonl -o m.png  loss and test accuracy against epochs and samples
//
// The training loop is LibTorch's own: a torch::nn MLP, a data loader, SGD.
// Three things make it data-parallel: the DistributedDataParallel wrapper
// (rank 0's weights broadcast, gradients averaged in buckets while backward
// runs), the TorchDistributedSampler (each rank its share of every epoch),
// and an all-reduce of the figures for the epoch's line (examples/report.hpp). Each rank runs
// LibTorch on one thread: the parallelism is the ranks. The default run
// trains 3 epochs on the first 8,192 samples (--train-samples) in a few
// seconds on 2 cores: about 80% on Fashion-MNIST (target 75%); the
// built-in classes overlap, so no classifier gets near 100% there: near
// 65% (target 60%).
// A checkpoint is LibTorch's own archive: the module's, the optimizer's and
// the sampler's save().

#include <gradsync/gradsync.hpp>
#include <gradsync/integration/torch.hpp>

#include "cli.hpp"
#include "data_source.hpp"
#include "report.hpp"
#include "torch_mlp.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

struct Args : example::RunArgs {
  Args() : RunArgs{.epochs = 3, .hidden = 128, .lr = 0.05, .target = 0.60, .train_samples = 8192, .test_samples = 4096,
                   .idx = {.target = 0.75}} {}
  // Checkpoints (--save, --resume: RunArgs) are saved after every epoch.
};

Args parse(int argc, char** argv) {
  Args a;
  a.parse(argc, argv, "libtorch_ddp", "", [](example::ArgReader&) { return false; },
          "The learning rate is --lr times the number of ranks.\n"
          "Checkpoints (--save) are written after every epoch.\n");
  if (a.train_samples < 1 || a.test_samples < 1) throw std::runtime_error("the sample counts must be positive");
  return a;
}

/// Samples as tensors: x (n x 784 floats) and y (n class indices).
struct Samples : torch::data::datasets::Dataset<Samples> {
  torch::Tensor x, y;
  /// The built-in data: 784 features, 10 classes. A class is a cloud around
  /// its centre in a 16-dimensional latent space (clouds overlap), seen
  /// through a random tanh layer as 784 values plus noise. Drawn from its
  /// own seeded generator, so every process of an MPI run builds the same tensors.
  Samples(std::int64_t n, std::uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto f = torch::kFloat;
    // The centres and the projection depend on `seed` only, train and test alike.
    auto shared = at::make_generator<at::CPUGeneratorImpl>(0x5eed);
    const torch::Tensor centres = torch::randn({10, 16}, shared, f) * 0.6;
    const torch::Tensor w = torch::randn({16, 784}, shared, f) * 0.5;
    y = torch::randint(10, {n}, gen, torch::kInt64);
    const torch::Tensor z = centres.index_select(0, y) + torch::randn({n, 16}, gen, f);
    x = torch::tanh(z.matmul(w)) + 0.1 * torch::randn({n, 784}, gen, f);
  }
  /// IDX data read by examples/data_source.hpp, copied into tensors.
  explicit Samples(const example::Dataset& d) {
    const auto n = static_cast<std::int64_t>(d.size());
    if (d.dim != 784) {
      throw std::runtime_error("the model takes 784 features (28 x 28 images); the data has " + std::to_string(d.dim));
    }
    x = torch::from_blob(const_cast<float*>(d.x.data()), {n, 784}, torch::kFloat).clone();
    y = torch::from_blob(const_cast<int*>(d.y.data()), {n}, torch::kInt32).to(torch::kInt64);
  }
  torch::data::Example<> get(std::size_t i) override {
    const auto k = static_cast<std::int64_t>(i);
    return {x[k], y[k]};
  }
  torch::optional<std::size_t> size() const override { return static_cast<std::size_t>(x.size(0)); }
};

std::string checkpoint_file(const std::string& dir) { return (std::filesystem::path(dir) / "checkpoint.pt").string(); }

/// Loads `net`'s weights from `archive` (read from `file`), refusing a
/// tensor of another shape, which Module::load would take in silence.
void load_weights(example::Net& net, torch::serialize::InputArchive& archive, const std::string& file) {
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes;
  for (const auto& p : net->named_parameters()) shapes.emplace_back(p.key(), p.value().sizes().vec());
  net->load(archive);
  for (const auto& [name, shape] : shapes) {
    const auto loaded = net->named_parameters()[name].sizes();
    if (loaded != c10::IntArrayRef(shape)) {
      throw std::runtime_error(file + " holds " + name + " of shape " + c10::str(loaded) + ", this model's is " +
                               c10::str(c10::IntArrayRef(shape)) + " (another --hidden?)");
    }
  }
}

/// How many of this rank's share of `test_set` `net` classifies right (the
/// ranks' shares together are the whole set).
template <class Comm>
double count_correct(Comm& comm, example::Net& net, const Samples& test_set) {
  net->eval();
  torch::NoGradGuard no_grad;
  const std::int64_t n_test = test_set.x.size(0);
  const std::int64_t share = (n_test + comm.size() - 1) / comm.size();
  const std::int64_t first = std::min(n_test, share * comm.rank());
  const std::int64_t count = std::min(share, n_test - first);
  if (count == 0) return 0;
  return net->forward(test_set.x.narrow(0, first, count))
      .argmax(1)
      .eq(test_set.y.narrow(0, first, count))
      .sum()
      .item<double>();
}

/// A Net with LibTorch's default initialisation drawn from `seed`. That
/// draws from the process's default generator, which the rank threads
/// share: seeding and drawing under one lock keeps another rank's
/// manual_seed from landing between them, so rank 0's weights (which DDP
/// gives every rank) depend on the seed alone, not on how the threads ran.
example::Net seeded_net(int hidden, std::uint64_t seed) {
  static std::mutex generator;
  const std::lock_guard<std::mutex> lock(generator);
  torch::manual_seed(seed);
  return example::Net(hidden);
}

/// What a checkpoint records of its run, to refuse a resume on other data
/// or at another --batch: (key, value) pairs.
std::vector<std::pair<std::string, std::string>> run_record(const example::DataChoice& data, const Samples& train,
                                                            const Args& a) {
  // The data's values too: a directory may hold other files by the resume.
  const torch::Tensor x = train.x.contiguous(), y = train.y.contiguous();
  const std::string values = example::content_checksum(
      std::span<const std::byte>(static_cast<const std::byte*>(x.data_ptr()), x.nbytes()),
      std::span<const std::byte>(static_cast<const std::byte*>(y.data_ptr()), y.nbytes()),
      static_cast<std::size_t>(x.size(0)));
  return {{"data", data.identity(a.seed)}, {"data_values", values}, {"batch", std::to_string(a.batch)}};
}

void set_lr(torch::optim::SGD& opt, double lr) {
  for (auto& group : opt.param_groups()) static_cast<torch::optim::SGDOptions&>(group.options()).lr(lr);
}

template <class Comm>
double train(Comm& comm, const Samples& train_set, const Samples& test_set, const example::DataChoice& data,
             const Args& a) {
  torch::set_num_threads(1);
  // Different inits on purpose: DDP makes them rank 0's.
  example::Net net = seeded_net(a.hidden, a.seed + static_cast<std::uint64_t>(comm.rank()));
  const auto n_train = static_cast<std::size_t>(train_set.x.size(0));
  gradsync::TorchDistributedSampler sampler(n_train, comm.size(), comm.rank(), {.seed = a.shuffle_seed()});
  // More ranks than samples, or a batch over a rank's share: refused, as
  // the linear scaling would be for a batch no step takes.
  example::check_share(sampler.num_samples(), n_train, comm.size(), a.batch);
  // What a checkpoint records of this run, where one is written or read.
  const auto record = a.save.empty() && a.resume.empty() ? std::vector<std::pair<std::string, std::string>>{}
                                                         : run_record(data, train_set, a);
  // Every rank reads the file; the weights before the wrapper is built,
  // since loading may swap a parameter's storage for the file's.
  torch::serialize::InputArchive checkpoint;
  if (!a.resume.empty()) {
    const std::string file = checkpoint_file(a.resume);
    if (!std::filesystem::is_regular_file(file)) {
      throw std::runtime_error("--resume " + a.resume + ": cannot open " + file + ", which --save DIR writes");
    }
    checkpoint.load_from(file);
    // The data and the batch are the run's: training on from another run's
    // state would go on without a word. (A checkpoint that records none
    // predates the record: accepted.)
    for (const auto& [key, value] : record) {
      c10::IValue saved;
      if (checkpoint.try_read(key, saved) && saved.isString() && saved.toStringRef() != value) {
        throw std::runtime_error("--resume " + a.resume + ": the checkpoint's run had " + key + " = '" +
                                 saved.toStringRef() + "', this one '" + value +
                                 "'; resume with the same data and --batch");
      }
    }
    torch::serialize::InputArchive model, state;
    checkpoint.read("model", model);
    load_weights(net, model, file);
    checkpoint.read("sampler", state);
    sampler.load(state);
  }
  gradsync::DistributedDataParallel ddp(comm, net);
  // The linear scaling rule: N ranks of batch b take steps of an N·b batch.
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(a.lr * comm.size()).momentum(0.9));
  if (!a.resume.empty()) {
    torch::serialize::InputArchive state;
    checkpoint.read("optimizer", state);
    opt.load(state);
    // The file's rate is its run's world size's: this run scales its own.
    set_lr(opt, a.lr * comm.size());
  }
  // A checkpoint is saved after an epoch: its sampler is at the next one's start.
  const int first_epoch = static_cast<int>(sampler.epoch());
  if (comm.rank() == 0) {
    std::printf("MLP 784-%d-%d-10 (%zu parameters, %zu buckets) on %s (%lld train / %lld test), %d ranks x batch %d, "
                "SGD lr %.3g momentum 0.9\n",
                a.hidden, a.hidden, static_cast<std::size_t>(torch::nn::utils::parameters_to_vector(net->parameters()).numel()),
                ddp.buckets().size(), data.name.c_str(), static_cast<long long>(train_set.x.size(0)),
                static_cast<long long>(test_set.x.size(0)), comm.size(), a.batch, a.lr * comm.size());
    if (!data.note.empty()) std::printf("data: %s\n", data.note.c_str());
    example::print_plan({.ranks = comm.size(), .train_samples = n_train, .samples_per_rank = sampler.num_samples(),
                         .batch = a.batch,
                         .optimizer = example::linear_scaling("SGD momentum 0.9", a.lr, a.batch, a.lr * comm.size(),
                                                              std::size_t(a.batch) * std::size_t(comm.size()),
                                                              a.warmup, a.warmup_steps(sampler.num_samples())) +
                                      ", constant over the epochs"});
    if (!a.resume.empty()) {
      std::printf("resumed from %s after epoch %d\n", checkpoint_file(a.resume).c_str(), first_epoch);
    }
    std::fflush(stdout);
  }
  if (first_epoch >= a.epochs) {
    if (comm.rank() == 0) {
      std::printf("nothing to train: the checkpoint is at epoch %d%s%d\n", first_epoch,
                  first_epoch == a.epochs ? " of " : ", past --epochs ", a.epochs);
      std::fflush(stdout);
    }
    std::vector<double> correct{count_correct(comm, net, test_set)};
    gradsync::AllReduce<>{}(comm, correct, gradsync::Sum{});
    return correct[0] / static_cast<double>(test_set.x.size(0));
  }
  // Rank 0 writes; a file's sampler state is the next epoch's start (the
  // loader owns the one it runs).
  auto save = [&](int done) {
    if (a.save.empty() || comm.rank() != 0) return;
    torch::serialize::OutputArchive out, model, optimizer, state;
    net->save(model);
    opt.save(optimizer);
    gradsync::TorchDistributedSampler next(n_train, comm.size(), comm.rank(), {.seed = a.shuffle_seed()});
    next.set_epoch(static_cast<std::uint64_t>(done));
    next.save(state);
    out.write("model", model);
    out.write("optimizer", optimizer);
    out.write("sampler", state);
    for (const auto& [key, value] : record) out.write(key, c10::IValue(value));
    // Written whole, then renamed: a crash leaves the previous checkpoint.
    std::filesystem::create_directories(a.save);
    const std::string file = checkpoint_file(a.save);
    out.save_to(file + ".tmp");
    std::filesystem::rename(file + ".tmp", file);
    std::printf("saved %s after epoch %d\n", file.c_str(), done);
    std::fflush(stdout);
  };

  const std::size_t per_rank = sampler.num_samples();
  auto loader = torch::data::make_data_loader(Samples(train_set).map(torch::data::transforms::Stack<>()),
                                              std::move(sampler),
                                              torch::data::DataLoaderOptions(static_cast<std::size_t>(a.batch)));
  example::Progress progress(comm.rank() == 0);
  // Optimizer steps so far: a resumed run starts after whole epochs.
  const std::size_t steps_per_epoch = (per_rank + std::size_t(a.batch) - 1) / std::size_t(a.batch);
  std::uint64_t step = std::uint64_t(first_epoch) * steps_per_epoch;
  example::MetricsFile metrics(comm.rank() == 0 ? a.metrics : "", comm.size(), a.batch, a.lr * comm.size(),
                               a.resume.empty() ? std::nullopt : std::optional<std::uint64_t>(step));
  // Every rank takes part in a step line's sums, so every rank counts the steps.
  const std::uint64_t every = a.metrics.empty() ? 0 : a.metrics_every;
  const std::uint64_t warmup_steps = a.warmup_steps(per_rank);
  double accuracy = 0;
  // Since the last step line, across epoch ends: loss x samples, samples,
  // right, and the seconds of the steps (evaluations left out).
  std::vector<double> window(3, 0.0);
  double window_seconds = 0;
  for (int epoch = first_epoch; epoch < a.epochs; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    ddp.reset_stats();
    net->train();
    double loss_sum = 0, samples = 0, right = 0;
    auto window_start = t0;
    for (auto& batch : *loader) {  // each pass is the next epoch of the sampler
      if (warmup_steps && step <= warmup_steps) {
        set_lr(opt, a.lr * comm.size() * example::warmed(step, warmup_steps));
        metrics.set_lr(a.lr * comm.size() * example::warmed(step, warmup_steps));
      }
      opt.zero_grad();
      const torch::Tensor logits = ddp(batch.data);
      torch::Tensor loss = torch::nn::functional::cross_entropy(logits, batch.target);
      loss.backward();  // returns with the gradients averaged over the ranks
      opt.step();
      ++step;
      // Scored from the forward pass the step made anyway, before its update.
      const double ok = logits.detach().argmax(1).eq(batch.target).sum().item<double>();
      const double b = static_cast<double>(batch.data.size(0)), l = loss.item<double>() * b;
      loss_sum += l;
      samples += b;
      right += ok;
      progress.update(epoch + 1, static_cast<std::size_t>(samples), per_rank, loss_sum / samples);
      if (every) {
        window[0] += l, window[1] += b, window[2] += ok;
        if (step % every == 0) {
          gradsync::AllReduce<>{}(comm, window, gradsync::Sum{});
          const auto now = std::chrono::steady_clock::now();
          const double s = window_seconds + std::chrono::duration<double>(now - window_start).count();
          metrics.write({.kind = "step", .epoch = epoch + 1, .step = step,
                         .samples_seen = (double(epoch) * double(per_rank) + samples) * comm.size(),
                         .loss = window[0] / window[1], .train_accuracy = window[2] / window[1], .seconds = s,
                         .samples_per_second = window[1] / s});
          std::fill(window.begin(), window.end(), 0.0);
          window_seconds = 0;
          window_start = now;
        }
      }
    }
    const auto t1 = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(t1 - t0).count();
    window_seconds += std::chrono::duration<double>(t1 - window_start).count();
    std::vector<double> sums{loss_sum, samples, count_correct(comm, net, test_set),
                             static_cast<double>(ddp.stats().buckets_launched_early),
                             static_cast<double>(ddp.stats().buckets_launched), right};
    gradsync::AllReduce<>{}(comm, sums, gradsync::Sum{});
    accuracy = sums[2] / static_cast<double>(test_set.x.size(0));
    if (comm.rank() == 0) {
      char tail[96];
      std::snprintf(tail, sizeof tail, "buckets started in backward %.0f of %.0f", sums[3], sums[4]);
      const example::EpochFigures f{.epoch = epoch + 1, .loss = sums[0] / sums[1], .train_accuracy = sums[5] / sums[1],
                                    .test_accuracy = accuracy, .samples = sums[1], .seconds = seconds, .tail = tail,
                                    .last = per_rank, .of = per_rank};
      progress.clear();
      example::print_epoch(f);
      metrics.write({.kind = "epoch", .epoch = f.epoch, .step = step,
                     .samples_seen = double(epoch + 1) * double(per_rank) * comm.size(), .loss = f.loss,
                     .train_accuracy = f.train_accuracy, .test_accuracy = accuracy, .seconds = seconds,
                     .samples_per_second = f.samples / seconds});
    }
    save(epoch + 1);
  }
  return accuracy;
}

}  // namespace

/// The train and test sets `data` chose, their first --train-samples and --test-samples.
std::pair<Samples, Samples> load(const example::DataChoice& data, const Args& a) {
  if (data.synthetic()) {
    return {Samples(static_cast<std::int64_t>(a.train_samples), a.seed),
            Samples(static_cast<std::int64_t>(a.test_samples), a.seed + 1)};
  }
  example::Dataset train, test;
  example::load_idx(train, test, data.dir, a.train_samples, a.test_samples);
  return {Samples(train), Samples(test)};
}

int main(int argc, char** argv) try {
  Args args = parse(argc, argv);
  const example::DataChoice data = example::choose_data(args.data, args.dataset);
  args.defaults_for(data.synthetic());
  const std::pair<Samples, Samples> sets = load(data, args);
  const example::Outcome outcome = example::run_on_backend(
      args.backend, args.ranks, [&](auto& comm) { return train(comm, sets.first, sets.second, data, args); });
  return example::finish(outcome, args.target);
} catch (const c10::Error& e) {
  // A file LibTorch cannot read, or of another model: its message, not its C++ backtrace.
  return example::exit_error("libtorch_ddp", e.what_without_backtrace());
} catch (const std::exception& e) {
  return example::exit_error("libtorch_ddp", e.what());
}
