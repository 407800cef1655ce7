#pragma once
// What the fully_shard tests share (on Threads and on Mpi): a model of two
// wrapped blocks and a root with a frozen parameter and a buffer, its
// initial state, the optimizers and the training loop.

#include "torch_ddp_support.hpp"

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace test_torch_fsdp_support {

using test_torch::Data;
using test_torch::state;

/// Two layers, 12·13 + 13 + 13·11 + 11 = 323 parameters for (12, 13, 11):
/// a unit no N in 2..4 divides.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int in, int hidden, int out)
      : a(register_module("a", torch::nn::Linear(in, hidden))),
        b(register_module("b", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(b(torch::relu(a(x)))); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Block);

/// b1 (323 parameters), b2 (11·9 + 9 + 9·10 + 10 = 208: 2 and 4 divide it,
/// 3 does not), then the root's own unit: head (55) and a frozen scale
/// (10), with a buffer added before the head. In double: the parity below
/// is then rounding apart, not float's cancellation magnified by Adam.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : b1(register_module("b1", Block(12, 13, 11))),
        b2(register_module("b2", Block(11, 9, 10))),
        head(register_module("head", torch::nn::Linear(10, 5))) {
    scale = register_parameter("scale", torch::full({10}, 1.5), /*requires_grad=*/false);
    shift = register_buffer("shift", torch::linspace(-0.5, 0.5, 10));
    to(torch::kDouble);
  }
  torch::Tensor forward(torch::Tensor x) { return head(b2(b1(x)) * scale + shift); }
  gradsync::ShardedModule<Block> b1, b2;
  torch::nn::Linear head;
  torch::Tensor scale, shift;
};
TORCH_MODULE(Net);

/// A Net's parameters and buffers from the case's seed, scale and shift too.
inline std::vector<torch::Tensor> initial_state(std::string_view salt) {
  auto rng = test::rng_for(salt);
  torch::manual_seed(rng());
  Net m;
  torch::NoGradGuard no_grad;
  m->scale.uniform_(0.5, 2.0);
  m->shift.normal_(0.0, 0.5);
  return state(*m);
}

enum class Opt { sgd_momentum, adam, adamw };

inline const char* opt_name(Opt o) {
  switch (o) {
    case Opt::sgd_momentum: return "SGD with momentum";
    case Opt::adam: return "Adam";
    case Opt::adamw: return "AdamW";
  }
  return "?";
}

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, torch::nn::Module& m) {
  switch (o) {
    case Opt::adam: return std::make_unique<torch::optim::Adam>(m.parameters(), torch::optim::AdamOptions(1e-2));
    case Opt::adamw:
      return std::make_unique<torch::optim::AdamW>(m.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    case Opt::sgd_momentum: break;
  }
  return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

/// `steps` optimizer steps of `forward` on x against y.
template <class Forward>
void fit(Forward forward, torch::optim::Optimizer& opt, const Data& d, int steps) {
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(forward(d.x), d.y).backward();
    opt.step();
  }
}

/// The values of a state dict, in its order (parameters, then buffers).
inline std::vector<torch::Tensor> values(const torch::OrderedDict<std::string, torch::Tensor>& dict) {
  std::vector<torch::Tensor> out;
  for (const auto& item : dict) out.push_back(item.value());
  return out;
}

/// b1, b2, then the root, as FSDP2 wants them: innermost first.
template <class B>
void wrap(gradsync::ShardedModule<Net>& m, gradsync::Communicator<B>& comm, const gradsync::FullyShardOptions& o) {
  gradsync::fully_shard(m->b1, comm, o);
  gradsync::fully_shard(m->b2, comm, o);
  gradsync::fully_shard(m, comm, o);
}


/// `init` loaded on rank 0 only (wrapping broadcasts it), then wrapped with `strategy`.
template <class B>
void load_and_wrap(gradsync::ShardedModule<Net>& m, gradsync::Communicator<B>& comm,
                   const std::vector<torch::Tensor>& init, gradsync::ShardingStrategy strategy) {
  if (comm.rank() == 0) test_torch::load_state(*m, init);
  gradsync::FullyShardOptions o;
  o.strategy = strategy;
  wrap(m, comm, o);
}

}  // namespace test_torch_fsdp_support
