#pragma once
/// \file detail::sharded_optimizer_entries: a torch::optim SGD's, Adam's or AdamW's state in a sharded save of a fully_shard model.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/util/string_utils.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include "gradsync/checkpoint/tensor_dtype.hpp"
#include "gradsync/integration/torch/sharded_state_entries.hpp"

namespace gradsync::detail {

/// One tensor of an optimizer's state in a sharded save, as
/// ShardedStateEntry says (`local`: the state's tensor now, undefined where
/// the optimizer has none yet), and how a loaded value (of the local
/// shape) becomes the optimizer's: run only once every rank agreed.
struct OptimizerStateEntry {
  ShardedStateEntry entry;
  std::function<void(const at::Tensor&)> set;
};

/// A getter of the optimizer's state under `key` (a parameter's), which
/// makes the state on first use: it runs only after every rank agreed, so
/// a load that fails leaves the optimizer as it was.
template <class State>
auto state_maker(torch::optim::Optimizer& opt, std::string key) {
  return [&opt, key = std::move(key)]() -> State& {
    auto& slot = opt.state()[key];
    if (!dynamic_cast<State*>(slot.get())) slot = std::make_unique<State>();
    return static_cast<State&>(*slot);
  };
}

/// An entry of a state tensor `field` of parameter `p` (of p's shape),
/// holding `now`; `put` stores a loaded value into the state `get` makes.
template <class State, class Get>
OptimizerStateEntry state_entry(const ShardedStateEntry& p, const std::string& field, at::Tensor now, Get get,
                                std::function<void(State&, at::Tensor)> put) {
  OptimizerStateEntry e;
  e.entry = p;
  e.entry.info.name = "optimizer." + p.info.name + "." + field;
  e.entry.local = std::move(now);
  const at::Tensor shape_of = p.local;
  e.set = [get, put = std::move(put), shape_of](const at::Tensor& v) { put(get(), v.view(shape_of.sizes()).clone()); };
  return e;
}

/// The state of `opt` for parameter `p` (null: none yet, which a save
/// refuses through `refusal`).
template <class State>
State* state_of(torch::optim::Optimizer& opt, const ShardedStateEntry& p, bool loading, std::string& refusal) {
  const std::string key = c10::guts::to_string(p.local.unsafeGetTensorImpl());
  auto found = opt.state().find(key);
  State* state = found != opt.state().end() ? dynamic_cast<State*>(found->second.get()) : nullptr;
  if (!state && !loading && refusal.empty()) {
    refusal = "the optimizer has no state for parameter '" + p.info.name +
              "' (no step yet): save after a step, or without the optimizer";
  }
  return state;
}

/// The trainable parameters among `params` that `opt` holds, each with its
/// group's options.
template <class Options>
std::vector<std::pair<const ShardedStateEntry*, const Options*>> held_by(torch::optim::Optimizer& opt,
                                                                       const std::vector<ShardedStateEntry>& params) {
  std::unordered_map<const c10::TensorImpl*, const Options*> group_of;
  for (auto& group : opt.param_groups()) {
    const auto* o = &static_cast<const Options&>(group.options());
    for (const at::Tensor& p : group.params()) group_of[p.unsafeGetTensorImpl()] = o;
  }
  std::vector<std::pair<const ShardedStateEntry*, const Options*>> out;
  for (const ShardedStateEntry& p : params) {
    auto it = group_of.find(p.local.unsafeGetTensorImpl());
    if (it != group_of.end() && p.local.requires_grad()) out.emplace_back(&p, it->second);  // frozen: no state
  }
  return out;
}

/// SGD's per-parameter state: with momentum, the momentum_buffer, of the
/// parameter's shape; without, none.
inline std::vector<OptimizerStateEntry> sgd_state_entries(torch::optim::Optimizer& opt,
                                                          const std::vector<ShardedStateEntry>& params, bool loading,
                                                          std::string& refusal) {
  using State = torch::optim::SGDParamState;
  std::vector<OptimizerStateEntry> out;
  for (const auto& [p, o] : held_by<torch::optim::SGDOptions>(opt, params)) {
    if (o->momentum() == 0) continue;
    State* state = state_of<State>(opt, *p, loading, refusal);
    out.push_back(state_entry<State>(*p, "momentum_buffer", state ? state->momentum_buffer() : at::Tensor(),
                                     state_maker<State>(opt, c10::guts::to_string(p->local.unsafeGetTensorImpl())),
                                     [](State& s, at::Tensor v) { s.momentum_buffer(std::move(v)); }));
  }
  return out;
}

/// Adam's and AdamW's per-parameter state, whose tensors have the shape of
/// the parameter's tensor (a unit's 1-D piece: 1/N of the state per rank).
template <class State, class Options>
std::vector<OptimizerStateEntry> adam_state_entries(torch::optim::Optimizer& opt,
                                                    const std::vector<ShardedStateEntry>& params, bool loading,
                                                    int rank, std::string& refusal) {
  std::vector<OptimizerStateEntry> out;
  for (const auto& [p, o] : held_by<Options>(opt, params)) {
    State* state = state_of<State>(opt, *p, loading, refusal);
    const auto get = state_maker<State>(opt, c10::guts::to_string(p->local.unsafeGetTensorImpl()));
    out.push_back(state_entry<State>(*p, "exp_avg", state ? state->exp_avg() : at::Tensor(), get,
                                     [](State& s, at::Tensor v) { s.exp_avg(std::move(v)); }));
    out.push_back(state_entry<State>(*p, "exp_avg_sq", state ? state->exp_avg_sq() : at::Tensor(), get,
                                     [](State& s, at::Tensor v) { s.exp_avg_sq(std::move(v)); }));
    if (o->amsgrad()) {
      out.push_back(state_entry<State>(*p, "max_exp_avg_sq", state ? state->max_exp_avg_sq() : at::Tensor(), get,
                                       [](State& s, at::Tensor v) { s.max_exp_avg_sq(std::move(v)); }));
    }
    // The step count, alike on every rank: rank 0's, a 0-d int64 tensor.
    OptimizerStateEntry step;
    step.entry.info = {"optimizer." + p->info.name + ".step", checkpoint::TensorDtype::I64, {}};
    step.entry.begin = 0;
    step.entry.end = 1;
    step.entry.writes = rank == 0;
    step.entry.local = torch::scalar_tensor(state ? state->step() : 0, at::TensorOptions().dtype(at::kLong));
    step.set = [get](const at::Tensor& v) { get().step(v.item<std::int64_t>()); };
    out.push_back(std::move(step));
  }
  return out;
}

/// The state tensors of `opt` for the module's parameters `params` (as
/// sharded_state_entries made them): SGD's momentum_buffer (with
/// momentum), Adam's and AdamW's exp_avg, exp_avg_sq (max_exp_avg_sq under
/// amsgrad) and step, named
/// "optimizer.<parameter>.<field>" as the trainers' checkpoints name
/// theirs. `loading`: the state may be absent (made at the load's commit).
/// `refusal` gets the first reason it cannot be saved or loaded.
inline std::vector<OptimizerStateEntry> sharded_optimizer_entries(torch::optim::Optimizer& opt,
                                                                  const std::vector<ShardedStateEntry>& params,
                                                                  bool loading, int rank, std::string& refusal) {
  if (dynamic_cast<torch::optim::SGD*>(&opt)) return sgd_state_entries(opt, params, loading, refusal);
  if (dynamic_cast<torch::optim::Adam*>(&opt)) {
    return adam_state_entries<torch::optim::AdamParamState, torch::optim::AdamOptions>(opt, params, loading, rank,
                                                                                       refusal);
  }
  if (dynamic_cast<torch::optim::AdamW*>(&opt)) {
    return adam_state_entries<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(opt, params, loading, rank,
                                                                                         refusal);
  }
  if (refusal.empty()) {
    refusal = "the optimizer is not torch::optim::SGD, Adam or AdamW, whose state a sharded state dict holds; "
              "save without it";
  }
  return {};
}

}  // namespace gradsync::detail
