#pragma once
// What the LibTorch DDP tests share: LibTorch included before doctest, the
// 12-input, 5-class data and models, parameter snapshots and their
// comparison, and the training loop both the reference and the ranks run.
//
// LibTorch before doctest: Debian's c10 logs through glog, whose CHECK,
// CHECK_EQ... macros would otherwise stand in for doctest's (and abort the
// process on failure instead of reporting it). A file with its own main
// defines DOCTEST_CONFIG_IMPLEMENT before including this header.

#include <gradsync/gradsync.hpp>
#include <gradsync/integration/torch.hpp>
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "../support/common.hpp"

namespace test_torch {

/// Inputs (12 features) and labels (5 classes) for `rows` samples.
struct Data {
  torch::Tensor x, y;
};

/// From the case's seed and `salt`.
inline Data make_data(std::int64_t rows, std::string_view salt) {
  auto rng = test::rng_for(salt);
  std::normal_distribution<float> normal;
  std::vector<float> xs(static_cast<std::size_t>(rows * 12));
  for (float& v : xs) v = normal(rng);
  std::vector<std::int64_t> ys(static_cast<std::size_t>(rows));
  for (auto& v : ys) v = static_cast<std::int64_t>(rng() % 5);
  return {torch::from_blob(xs.data(), {rows, 12}).clone(), torch::from_blob(ys.data(), {rows}, torch::kInt64).clone()};
}

/// A 12-24-5 MLP whose parameters are stored in `dtype`. LibTorch 1.13 has
/// no half matmul on the CPU ("addmm_impl_cpu_ not implemented for 'Half'"),
/// so layers compute in `compute` (bfloat16 itself, or float for half): the
/// gradients reaching the parameters are still of the parameters' dtype.
struct TypedMlpImpl : torch::nn::Module {
  TypedMlpImpl(torch::Dtype dtype, torch::Dtype compute)
      : fc1(register_module("fc1", torch::nn::Linear(12, 24))),
        fc2(register_module("fc2", torch::nn::Linear(24, 5))),
        compute_(compute) {
    to(dtype);
  }
  torch::Tensor layer(const torch::nn::Linear& l, const torch::Tensor& x) {
    return torch::linear(x, l->weight.to(compute_), l->bias.to(compute_));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return layer(fc2, torch::tanh(layer(fc1, x.to(compute_)))).to(torch::kFloat);
  }
  torch::nn::Linear fc1, fc2;
  torch::Dtype compute_;
};
TORCH_MODULE(TypedMlp);

/// fc1 (12 to 20), a BatchNorm1d over its outputs, tanh, fc2 (20 to 5), in
/// double: a first layer to freeze, as when fine-tuning on a pre-trained
/// backbone, and buffers (the BatchNorm's running statistics) to broadcast.
struct BackboneNetImpl : torch::nn::Module {
  BackboneNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(12, 20))),
        bn(register_module("bn", torch::nn::BatchNorm1d(20))),
        fc2(register_module("fc2", torch::nn::Linear(20, 5))) {
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(bn(fc1(x)))); }
  void freeze_fc1() {
    fc1->weight.requires_grad_(false);
    fc1->bias.requires_grad_(false);
  }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};
TORCH_MODULE(BackboneNet);

/// Parameters, then buffers, copied to the host.
inline std::vector<torch::Tensor> state(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().to(torch::kCPU).clone());
  for (const auto& b : m.buffers()) out.push_back(b.detach().to(torch::kCPU).clone());
  return out;
}

inline void load_state(torch::nn::Module& m, const std::vector<torch::Tensor>& values) {
  torch::NoGradGuard no_grad;
  auto tensors = m.parameters();
  for (const auto& b : m.buffers()) tensors.push_back(b);
  REQUIRE(tensors.size() == values.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(values[i]);
}

/// A BackboneNet's state from `seed`: LibTorch's initial weights, and
/// running statistics as a pre-trained backbone would have them.
inline std::vector<torch::Tensor> backbone_state(std::uint64_t seed) {
  torch::manual_seed(seed);
  BackboneNet m;
  torch::NoGradGuard no_grad;
  m->bn->running_mean.normal_(0.0, 0.5);
  m->bn->running_var.uniform_(0.5, 2.0);
  m->bn->num_batches_tracked.fill_(static_cast<double>(seed % 1000));
  return state(*m);
}

/// A BackboneNet from `state`, set up for fine-tuning: fc1 frozen, the
/// BatchNorm in eval mode (its running statistics normalise), so that one
/// process on the N·b batch computes what N ranks of batch b do.
inline BackboneNet fine_tuned_backbone(const std::vector<torch::Tensor>& values) {
  BackboneNet m;
  load_state(*m, values);
  m->freeze_fc1();
  m->eval();
  return m;
}

/// The parameters' values, copied to the host.
inline std::vector<torch::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().to(torch::kCPU).clone());
  return out;
}

inline void load(torch::nn::Module& m, const std::vector<torch::Tensor>& values) {
  torch::NoGradGuard no_grad;
  auto params = m.parameters();
  REQUIRE(params.size() == values.size());
  for (std::size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
}

/// ‖a − b‖ / ‖b‖, the largest over the tensors.
inline double max_relative(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double diff = (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).norm().item<double>();
    const double ref = b[i].to(torch::kDouble).norm().item<double>();
    worst = std::max(worst, ref > 0 ? diff / ref : diff);
  }
  return worst;
}

/// Results of a run_ranks call, one slot per rank.
struct PerRank {
  explicit PerRank(int n) : params(static_cast<std::size_t>(n)), errors(static_cast<std::size_t>(n)) {}
  std::vector<std::vector<torch::Tensor>> params;
  std::vector<std::string> errors;
};

/// Runs `body` on every rank of a Threads world; an InvalidArgument a rank
/// throws is recorded, not raised.
template <class F>
PerRank run_ranks(int n, F body) {
  PerRank out(n);
  gradsync::run_threads(n, [&](gradsync::Communicator<gradsync::Threads>& comm) {
    torch::set_num_threads(1);
    const auto r = static_cast<std::size_t>(comm.rank());
    try {
      out.params[r] = body(comm);
    } catch (const gradsync::InvalidArgument& e) {
      out.errors[r] = e.what();
    }
  });
  return out;
}

/// A world of `least` to `least + choices - 1` ranks and one of its ranks,
/// drawn from `rng` in that order: for a case where one rank acts apart.
struct OddRank {
  int n = 0;
  int rank = 0;
};
inline OddRank draw_odd_rank(std::mt19937_64& rng, int least, int choices) {
  const int n = least + static_cast<int>(rng() % static_cast<unsigned>(choices));
  return {n, static_cast<int>(rng() % static_cast<unsigned>(n))};
}

/// How each rank's body ended in a run meant to fail ("returned",
/// "InvalidArgument" or "other", with the exception's words), and the run's seconds.
struct Outcomes {
  std::vector<std::string> kind, what;
  double seconds = 0;
};

/// Runs `body(comm)` on `n` ranks of a Threads world whose waits give up
/// after 10 s, recording how each rank ended; nothing is rethrown.
template <class F>
Outcomes run_failing(int n, F body) {
  Outcomes out{std::vector<std::string>(static_cast<std::size_t>(n), "returned"),
               std::vector<std::string>(static_cast<std::size_t>(n)), 0};
  const auto t0 = std::chrono::steady_clock::now();
  try {
    gradsync::run_threads(n, gradsync::ThreadsOptions{.timeout = std::chrono::seconds(10)},
                          [&](gradsync::Communicator<gradsync::Threads>& comm) {
                            torch::set_num_threads(1);
                            const auto r = static_cast<std::size_t>(comm.rank());
                            try {
                              body(comm);
                            } catch (const gradsync::InvalidArgument& e) {
                              out.kind[r] = "InvalidArgument";
                              out.what[r] = e.what();
                              throw;
                            } catch (const std::exception& e) {
                              out.kind[r] = "other";
                              out.what[r] = e.what();
                              throw;
                            }
                          });
  } catch (const std::exception&) {
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

/// ‖a − b‖ / ‖b‖ over all tensors together, in double.
inline double relative(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).pow(2).sum().item<double>();
    ref += b[i].to(torch::kDouble).pow(2).sum().item<double>();
  }
  return std::sqrt(diff / ref);
}

inline bool bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

inline torch::optim::SGD make_sgd(torch::nn::Module& m) {
  return torch::optim::SGD(m.parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
}

/// `steps` optimizer steps on the cross-entropy of the net's output for x
/// against y; `net` is a module holder (the one-process reference) or a
/// DistributedDataParallel.
template <class Net>
void train(Net& net, torch::optim::Optimizer& opt, const torch::Tensor& x, const torch::Tensor& y, int steps) {
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    // A holder's operator() cannot pick among overloads of forward: call it directly.
    torch::Tensor out;
    if constexpr (requires { net->forward(x); }) {
      out = net->forward(x);
    } else {
      out = net(x);
    }
    torch::nn::functional::cross_entropy(out, y).backward();
    opt.step();
  }
}

/// `steps` SGD steps (make_sgd) of `net` alone on x against y: the
/// one-process reference. Returns its state (parameters, then buffers).
template <class Net>
std::vector<torch::Tensor> train_alone(Net& net, const torch::Tensor& x, const torch::Tensor& y, int steps) {
  auto opt = make_sgd(*net);
  train(net, opt, x, y, steps);
  return state(*net);
}

/// `steps` SGD steps of `net` wrapped in DistributedDataParallel over `comm`
/// on this rank's rows x against y. Returns its state (parameters, then buffers).
template <class Comm, class Net>
std::vector<torch::Tensor> train_ddp(Comm& comm, Net& net, const torch::Tensor& x, const torch::Tensor& y, int steps) {
  gradsync::DistributedDataParallel ddp(comm, net);
  auto opt = make_sgd(*net);
  train(ddp, opt, x, y, steps);
  return state(*net);
}

}  // namespace test_torch
