#pragma once
/// \file ShardedModule: a LibTorch module holder whose call gathers, runs and frees a fully_shard unit.

#include <cstddef>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "gradsync/core/error.hpp"
#include "gradsync/integration/torch/torch_unit_registry.hpp"

namespace gradsync {

namespace detail {

/// The tensors among a forward's arguments or result that backward can
/// reach: a Tensor, or the Tensors of a vector, tuple or pair of them.
inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect_tensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <class... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... e) { (collect_tensors(e, out), ...); }, t);
}
template <class A, class B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
/// Anything else carries no tensor backward goes through.
template <class T>
void collect_tensors(const T& /*value*/, std::vector<at::Tensor>& /*out*/) {}

/// Throws InvalidArgument if `module`, not wrapped itself, holds units and
/// trainable parameters that no unit holds: nothing would average their
/// gradients, and each rank would step its own (the root left unwrapped).
inline void check_outside_units(const torch::nn::Module& module) {
  bool has_units = false;
  for (const auto& sub : module.modules(/*include_self=*/false)) {
    if (find_torch_unit(sub.get())) {
      has_units = true;
      break;
    }
  }
  if (!has_units) return;
  const std::unordered_set<const void*> held = torch_unit_held_parameters();
  std::string outside;
  std::size_t count = 0;
  for (const auto& np : module.named_parameters(/*recurse=*/true)) {
    if (!np.value().requires_grad() || held.contains(np.value().unsafeGetTensorImpl())) continue;
    if (count++ < 4) outside += (outside.empty() ? "'" : ", '") + np.key() + "'";
  }
  if (count == 0) return;
  if (count > 4) outside += " and " + std::to_string(count - 4) + " more";
  throw InvalidArgument("gradsync: module '" + module.name() + "' holds fully_shard units, but its parameters " +
                        outside + " are in none: nothing would average their gradients across ranks, and each "
                        "rank would train its own. Wrap the root too, after its children (gradsync::fully_shard("
                        "net, comm)), as FSDP2 does");
}

}  // namespace detail

/// A module holder (`Block`, from TORCH_MODULE(Block)) for a child or a
/// root that gradsync::fully_shard wraps. Declare the wrapped children of
/// a model with it and call them as usual; its call is where LibTorch,
/// which has no forward hooks in C++, hands a unit control:
///
///     struct NetImpl : torch::nn::Module {
///       gradsync::ShardedModule<Block> b1{register_module("b1", Block(12, 32))};
///       torch::Tensor forward(torch::Tensor x) { return b1(x); }   // gathers, runs, frees
///     };
///
/// `b1(x)` gathers the unit's parameters (if sharded), hooks the tensor
/// arguments (their gradient complete: the unit's backward is done), runs
/// `b1->forward(x)`, hooks the result's tensors (their gradient arriving:
/// the unit's backward starts) and frees the parameters as the strategy says. Calling
/// `b1->forward(x)` instead skips all that: the parameters would be this
/// rank's flat shard. Before fully_shard it behaves as `Block` does.
///
/// \tparam Holder  a TORCH_MODULE holder type.
template <class Holder>
class ShardedModule : public Holder {
 public:
  using holder_type = Holder;
  using Impl = typename Holder::ContainedType;

  ShardedModule() = default;
  ShardedModule(std::nullptr_t) : Holder(nullptr) {}  // NOLINT: as LibTorch's holders
  ShardedModule(Holder holder) : Holder(std::move(holder)) {}  // NOLINT: register_module's result
  ShardedModule(const torch::nn::ModuleHolder<Impl>& holder) : Holder(holder.ptr()) {}  // NOLINT
  ShardedModule(std::shared_ptr<Impl> module) : Holder(std::move(module)) {}  // NOLINT
  /// Constructs the module from `args`, as `Holder(args...)` does.
  template <class First, class... Rest>
    requires(!std::is_convertible_v<First &&, std::shared_ptr<Impl>> &&
             !std::is_base_of_v<torch::nn::ModuleHolder<Impl>, std::remove_cvref_t<First>> &&
             std::is_constructible_v<Impl, First &&, Rest && ...>)
  explicit ShardedModule(First&& first, Rest&&... rest)
      : Holder(std::make_shared<Impl>(std::forward<First>(first), std::forward<Rest>(rest)...)) {}
  ShardedModule(const ShardedModule&) = default;
  ShardedModule(ShardedModule&&) noexcept = default;
  ShardedModule& operator=(const ShardedModule&) = default;
  ShardedModule& operator=(ShardedModule&&) noexcept = default;

  /// The last holder of a module (a model's root, typically) drops the
  /// units under it: the registry would keep them, with their spare gather
  /// buffers and worker, until the next fully_shard.
  ~ShardedModule() {
    if (this->is_empty() || this->ptr().use_count() != 1) return;
    try {
      detail::drop_torch_units_under(*this->ptr());
    } catch (...) {
      // modules() allocates; the registry's purge drops them later.
    }
  }

  /// `module->forward(args...)`, between the unit's pre- and post-forward
  /// when the module was wrapped by fully_shard.
  template <class... Args>
  auto operator()(Args&&... args) {
    std::shared_ptr<detail::TorchUnit> unit = detail::find_torch_unit(this->ptr().get());
    if (!unit) {
      // Where a backward may follow, parameters no unit holds must not be trained apart.
      if (c10::GradMode::is_enabled()) detail::check_outside_units(*this->ptr());
      return this->get()->forward(std::forward<Args>(args)...);
    }
    std::vector<at::Tensor> inputs;
    (detail::collect_tensors(args, inputs), ...);
    unit->pre_forward(inputs);
    // A forward that throws may leave a gather in flight, issued ahead of a
    // unit it would have reached: the unit lets it end before the exception goes on.
    struct Failed {
      detail::TorchUnit& unit;
      bool over = false;
      ~Failed() {
        if (!over) unit.forward_failed();
      }
    } failed{*unit};
    auto out = this->get()->forward(std::forward<Args>(args)...);
    failed.over = true;
    std::vector<at::Tensor> outputs;
    detail::collect_tensors(out, outputs);
    unit->post_forward(outputs);
    return out;
  }
};

}  // namespace gradsync
