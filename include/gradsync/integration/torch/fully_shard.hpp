#pragma once
/// \file fully_shard: PyTorch FSDP2's fully_shard for a LibTorch module, on a host gradsync communicator.

#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/integration/torch/fully_shard_options.hpp"
#include "gradsync/integration/torch/sharded_module.hpp"
#include "gradsync/integration/torch/tensor.hpp"
#include "gradsync/integration/torch/torch_sharded_unit.hpp"
#include "gradsync/integration/torch/torch_unit_registry.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/common/unit_agreement.hpp"
#include "gradsync/train/fsdp/options.hpp"
#include "gradsync/train/fsdp/sharding_strategy.hpp"

namespace gradsync {

/// Makes `module` one sharded unit, as PyTorch FSDP2's fully_shard does:
/// its parameters that no inner unit holds are flattened, padded to a
/// multiple of N and split over the N ranks of `comm`. Wrap the inner
/// modules first, then the root:
///
///     // struct NetImpl { gradsync::ShardedModule<Block> b1, b2; torch::nn::Linear head; ... };
///     gradsync::ShardedModule<Net> net;
///     gradsync::fully_shard(net->b1, comm);
///     gradsync::fully_shard(net->b2, comm);
///     gradsync::fully_shard(net, comm);                 // head: the root's own unit
///     torch::optim::AdamW opt(net->parameters(), 1e-3);  // steps on this rank's shards
///     auto loss = torch::mse_loss(net(x), y);            // through ShardedModule's call
///     loss.backward();                                   // returns with averaged shard gradients
///     opt.step();
///
/// Afterwards each parameter of the unit holds, between steps, this rank's
/// piece of the unit's flat shard (1-D, possibly empty), and its `.grad` the
/// matching piece of the averaged gradient, so an optimizer built on
/// `module->parameters()` (SGD, Adam, AdamW: any that works element by
/// element) keeps 1/N of its state. The call of a ShardedModule gathers
/// the unit's parameters for its forward; FullyShardOptions::strategy says
/// when they are freed.
///
/// Collective: every rank must wrap the same module (its class name, the
/// parameters' and buffers' names and shapes, which are frozen) with the
/// same options, else every rank throws InvalidArgument naming the first
/// difference. A module wrapped twice, or inside one already wrapped (wrap
/// children before their parent), is refused on every rank, as are
/// parameters that are not contiguous CPU tensors of float or double, or
/// of two dtypes in one unit. With sync_module_states (the default), rank
/// 0's parameters and buffers of the unit are then broadcast.
///
/// Buffers are broadcast only then; a forward does not broadcast them.
/// One unit belongs to one thread (one rank), as its communicator does.
///
/// \tparam Holder  the TORCH_MODULE holder type under ShardedModule.
/// \tparam B       a backend over host memory (Threads, Mpi).
template <class Holder, Backend B>
void fully_shard(ShardedModule<Holder>& module, Communicator<B>& comm, FullyShardOptions options = {}) {
  static_assert(backend_traits<B>::host_memory,
                "gradsync::fully_shard moves CPU tensors: pass a Communicator over host memory (Threads, Mpi)");
  using Unit = detail::TorchShardedUnit<B>;
  const std::string rank = std::to_string(comm.rank());
  std::shared_ptr<torch::nn::Module> root = module.ptr();
  if (!root) throw InvalidArgument("gradsync: fully_shard on rank " + rank + ": the ShardedModule holds no module");

  // Checked here and agreed on below, so a rank that refuses does not
  // leave the others waiting in the agreement's collective.
  std::string refusal;
  if (options.strategy == ShardingStrategy::HybridShard) {
    ShardedTrainerOptions hybrid;
    hybrid.strategy = options.strategy;
    hybrid.shard_size = options.shard_size;
    try {
      detail::fsdp::shard_group_size(hybrid, comm.size(), "FullyShardOptions::shard_size");
    } catch (const InvalidArgument& e) {
      refusal = e.what();
    }
  }
  for (const auto& [what, dtype] : {std::pair{"param_dtype", options.param_dtype},
                                    std::pair{"reduce_dtype", options.reduce_dtype}}) {
    if (refusal.empty() && dtype && !c10::isFloatingType(*dtype)) {
      refusal = std::string("FullyShardOptions::") + what + " is " + c10::toString(*dtype) +
                "; give a floating dtype (torch::kBFloat16, torch::kHalf, torch::kFloat)";
    }
  }
  if (refusal.empty() && options.param_dtype && options.strategy == ShardingStrategy::NoShard) {
    refusal = "FullyShardOptions::param_dtype needs a sharded strategy (FullShard, ShardGradOp, HybridShard): "
              "NoShard's parameters are the optimizer's, with no master copy to keep apart";
  }
  if (refusal.empty() && detail::find_torch_unit(root.get())) {
    refusal = "module '" + root->name() + "' was already wrapped by fully_shard; wrap each module once";
  }
  // What inner units hold is theirs; only the rest becomes this unit.
  std::unordered_set<const c10::TensorImpl*> inner;
  bool encloses = false;
  for (const auto& sub : root->modules(/*include_self=*/false)) {
    if (auto u = detail::find_torch_unit(sub.get())) {
      encloses = true;
      for (const at::Tensor& t : u->parameters()) inner.insert(t.unsafeGetTensorImpl());
      for (const at::Tensor& t : u->buffers()) inner.insert(t.unsafeGetTensorImpl());
    }
  }
  std::vector<typename Unit::Param> params;
  std::vector<at::Tensor> buffers;
  UnitSpec spec{root->name(), {}, {}};
  auto shape_of = [](const at::Tensor& t) {
    std::vector<std::size_t> s;
    for (std::int64_t d : t.sizes()) s.push_back(static_cast<std::size_t>(d));
    return s;
  };
  // LibTorch's named_parameters() lists a tensor once per name it is
  // registered under (tied weights: an embedding and its output head);
  // sharded once, under its first name, it gets one gradient slot, where
  // two slots of one tensor would each take part of its gradient.
  std::unordered_set<const c10::TensorImpl*> listed;
  for (const auto& np : root->named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = np.value();
    if (inner.contains(t.unsafeGetTensorImpl()) || !listed.insert(t.unsafeGetTensorImpl()).second) continue;
    typename Unit::Param p;
    p.name = np.key();
    p.tensor = t;
    p.shape = t.sizes().vec();
    p.trainable = t.requires_grad();
    spec.params.push_back({p.name + (p.trainable ? "" : " (frozen)"), shape_of(t)});
    if (refusal.empty()) {
      if (auto owner = detail::torch_unit_holding(t)) {
        refusal = "parameter '" + p.name + "' already belongs to the unit of module '" + owner->module()->name() +
                  "', wrapped earlier: wrap the inner modules first, then the modules that contain them";
      } else if (std::string why = detail::unusable_reason(t); !why.empty()) {
        refusal = "parameter '" + p.name + "' cannot be sharded: " + why;
      } else if (t.scalar_type() != c10::ScalarType::Float && t.scalar_type() != c10::ScalarType::Double) {
        refusal = "parameter '" + p.name + "' is " + c10::toString(t.scalar_type()) +
                  "; fully_shard shards float and double parameters";
      } else if (!params.empty() && t.scalar_type() != params[0].tensor.scalar_type()) {
        refusal = "parameter '" + p.name + "' is " + c10::toString(t.scalar_type()) + " where '" + params[0].name +
                  "' is " + c10::toString(params[0].tensor.scalar_type()) + "; one unit's parameters share a dtype";
      }
    }
    params.push_back(std::move(p));
  }
  for (const auto& nb : root->named_buffers(/*recurse=*/true)) {
    const at::Tensor& t = nb.value();
    if (inner.contains(t.unsafeGetTensorImpl())) continue;
    spec.buffers.push_back({nb.key(), shape_of(t)});
    if (refusal.empty() && options.sync_module_states) {
      if (std::string why = detail::unusable_reason(t); !why.empty()) {
        refusal = "buffer '" + nb.key() + "' cannot be broadcast: " + why;
      }
    }
    buffers.push_back(t);
  }

  // A refusing rank's parameters may be another unit's shards, whose
  // shapes differ by rank: the verdict alone is compared then.
  if (!refusal.empty()) spec = UnitSpec{root->name(), {}, {}};
  const std::vector<detail::AgreedValue> agreed{
      {"FullyShardOptions::strategy", name(options.strategy), "Give every rank the same FullyShardOptions."},
      {"FullyShardOptions::shard_size", std::to_string(options.shard_size),
       "Give every rank the same FullyShardOptions: HybridShard's groups are made from it."},
      {"FullyShardOptions::param_dtype", options.param_dtype ? c10::toString(*options.param_dtype) : "unset",
       "Give every rank the same FullyShardOptions."},
      {"FullyShardOptions::reduce_dtype", options.reduce_dtype ? c10::toString(*options.reduce_dtype) : "unset",
       "Give every rank the same FullyShardOptions."},
      {"FullyShardOptions::sync_module_states", options.sync_module_states ? "true" : "false",
       "Give every rank the same FullyShardOptions."},
      {"FullyShardOptions::max_gathered_units", std::to_string(options.max_gathered_units),
       "Give every rank the same FullyShardOptions: the gathers issued ahead follow from it."},
      {"fully_shard's verdict", refusal.empty() ? "accepted" : "refused: " + refusal,
       "Every rank must wrap the same modules in the same order."}};
  detail::check_units_agree(comm, {detail::describe_unit(spec)}, "fully_shard",
                            "Every rank must wrap the same modules, innermost first, in the same order, with the same "
                            "parameters frozen.",
                            agreed);
  if (!refusal.empty()) throw InvalidArgument("gradsync: fully_shard on rank " + rank + ": " + refusal);

  // How errors name the unit: its module's class and first parameters'
  // names and shapes (a child does not know where it sits in its parent).
  UnitSpec brief{spec.name, {}, {}};
  for (std::size_t i = 0; i < spec.params.size() && i < 2; ++i) brief.params.push_back(spec.params[i]);
  std::string description = detail::describe_unit(brief);
  if (spec.params.size() > 2) description.insert(description.size() - 1, ", …");
  auto unit = std::make_shared<Unit>(comm, root, std::move(params), std::move(buffers), options,
                                     detail::next_torch_unit_index(&comm), std::move(description));
  unit->set_encloses(encloses);
  unit->init();
  detail::add_torch_unit(std::move(unit));
}

}  // namespace gradsync
