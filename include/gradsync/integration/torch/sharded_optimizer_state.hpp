#pragma once
/// \file detail::sharded_optimizer_entries: a torch::optim Adam's or AdamW's state in a sharded save of a fully_shard model.

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

/// Adam's and AdamW's per-parameter state, whose tensors have the shape of
/// the parameter's tensor (a unit's 1-D piece: 1/N of the state per rank).
template <class State, class Options>
std::vector<OptimizerStateEntry> adam_state_entries(torch::optim::Optimizer& opt,
                                                    const std::vector<ShardedStateEntry>& params, bool loading,
                                                    int rank, std::string& refusal) {
  std::unordered_map<const c10::TensorImpl*, bool> amsgrad;  // the optimizer's parameters, by their group's option
  for (auto& group : opt.param_groups()) {
    const bool a = static_cast<const Options&>(group.options()).amsgrad();
    for (const at::Tensor& p : group.params()) amsgrad[p.unsafeGetTensorImpl()] = a;
  }
  std::vector<OptimizerStateEntry> out;
  for (const ShardedStateEntry& p : params) {
    auto it = amsgrad.find(p.local.unsafeGetTensorImpl());
    if (it == amsgrad.end() || !p.local.requires_grad()) continue;  // not the optimizer's, or frozen: no state
    const std::string key = c10::guts::to_string(p.local.unsafeGetTensorImpl());
    auto found = opt.state().find(key);
    State* state = found != opt.state().end() ? dynamic_cast<State*>(found->second.get()) : nullptr;
    if (!state && !loading && refusal.empty()) {
      refusal = "the optimizer has no state for parameter '" + p.info.name +
                "' (no step yet): save after a step, or without the optimizer";
    }
    // Made on first use, after the agreement: a load that fails leaves the optimizer as it was.
    auto get_state = [&opt, key]() -> State& {
      auto& slot = opt.state()[key];
      if (!dynamic_cast<State*>(slot.get())) slot = std::make_unique<State>();
      return static_cast<State&>(*slot);
    };
    const at::Tensor shape_of = p.local;
    auto add = [&](const std::string& field, at::Tensor now, std::function<void(State&, at::Tensor)> put) {
      OptimizerStateEntry e;
      e.entry = p;
      e.entry.info.name = "optimizer." + p.info.name + "." + field;
      e.entry.local = std::move(now);
      e.set = [get_state, put, shape_of](const at::Tensor& v) { put(get_state(), v.view(shape_of.sizes()).clone()); };
      out.push_back(std::move(e));
    };
    add("exp_avg", state ? state->exp_avg() : at::Tensor(), [](State& s, at::Tensor v) { s.exp_avg(std::move(v)); });
    add("exp_avg_sq", state ? state->exp_avg_sq() : at::Tensor(),
        [](State& s, at::Tensor v) { s.exp_avg_sq(std::move(v)); });
    if (it->second) {
      add("max_exp_avg_sq", state ? state->max_exp_avg_sq() : at::Tensor(),
          [](State& s, at::Tensor v) { s.max_exp_avg_sq(std::move(v)); });
    }
    // The step count, alike on every rank: rank 0's, a 0-d int64 tensor.
    OptimizerStateEntry step;
    step.entry.info = {"optimizer." + p.info.name + ".step", checkpoint::TensorDtype::I64, {}};
    step.entry.begin = 0;
    step.entry.end = 1;
    step.entry.writes = rank == 0;
    step.entry.local = torch::scalar_tensor(state ? state->step() : 0, at::TensorOptions().dtype(at::kLong));
    step.set = [get_state](const at::Tensor& v) { get_state().step(v.item<std::int64_t>()); };
    out.push_back(std::move(step));
  }
  return out;
}

/// The state tensors of `opt` for the module's parameters `params` (as
/// sharded_state_entries made them): Adam's and AdamW's exp_avg,
/// exp_avg_sq (max_exp_avg_sq under amsgrad) and step, named
/// "optimizer.<parameter>.<field>" as the trainers' checkpoints name
/// theirs. `loading`: the state may be absent (made at the load's commit).
/// `refusal` gets the first reason it cannot be saved or loaded.
inline std::vector<OptimizerStateEntry> sharded_optimizer_entries(torch::optim::Optimizer& opt,
                                                                  const std::vector<ShardedStateEntry>& params,
                                                                  bool loading, int rank, std::string& refusal) {
  if (dynamic_cast<torch::optim::Adam*>(&opt)) {
    return adam_state_entries<torch::optim::AdamParamState, torch::optim::AdamOptions>(opt, params, loading, rank,
                                                                                       refusal);
  }
  if (dynamic_cast<torch::optim::AdamW*>(&opt)) {
    return adam_state_entries<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(opt, params, loading, rank,
                                                                                         refusal);
  }
  if (refusal.empty()) {
    refusal = "the optimizer is neither torch::optim::Adam nor AdamW, whose state a sharded state dict holds; "
              "save without it";
  }
  return {};
}

}  // namespace gradsync::detail
