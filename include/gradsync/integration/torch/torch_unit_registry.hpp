#pragma once
/// \file detail::TorchUnit and its registry: what fully_shard made of a LibTorch module, found from the module.
///
/// LibTorch 1.13's C++ modules have no forward hooks and no slot for user
/// state, so a unit is kept here, keyed by its module's address, and
/// ShardedModule::operator() looks it up before and after each forward.
/// A module freed and another allocated at its address is told apart by the
/// unit's weak reference to the module it was made for.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace gradsync::detail {

/// One wrapped module's parameters (those no inner unit holds): the
/// lifecycle ShardedModule drives, and what fully_shard and
/// full_state_dict ask of an existing unit, without its backend.
class TorchUnit {
 public:
  virtual ~TorchUnit() = default;

  /// Before the module's forward: its full parameters, gathered if sharded,
  /// and hooks on the `inputs` that require a gradient (their gradient
  /// complete is the unit's backward done).
  virtual void pre_forward(const std::vector<at::Tensor>& inputs) = 0;
  /// After it: hooks on the `outputs` that require a gradient (their
  /// gradient arriving is the unit's backward starting), then frees the
  /// gathered parameters as the strategy says.
  virtual void post_forward(const std::vector<at::Tensor>& outputs) = 0;
  /// The module's forward threw between the two: what was gathered ahead
  /// of it is waited for and freed, so no collective is left in flight.
  virtual void forward_failed() noexcept = 0;
  /// The module's parameters and buffers this unit holds (the tensors
  /// themselves, whose data it swaps), in registration order.
  virtual const std::vector<at::Tensor>& parameters() const = 0;
  virtual const std::vector<at::Tensor>& buffers() const = 0;
  /// Collective over the unit's communicator: a copy of each parameter's
  /// full value, in parameters() order.
  virtual std::vector<at::Tensor> full_parameters() = 0;
  /// After a backward each trainable parameter's `.grad` is its piece of
  /// this rank's gradient shard, or under NoShard its whole gradient,
  /// alike on every rank (sharded() false).
  virtual bool sharded() const = 0;
  /// Copies of the unit's shards over the ranks: HybridShard's shard
  /// groups, 1 otherwise (the shard's norm is summed over every rank).
  virtual int replicas() const = 0;
  /// Bytes this rank keeps between steps for the unit's parameters and
  /// their gradients: twice the padded shard (the whole unit under NoShard).
  virtual std::size_t persistent_bytes() const = 0;

  /// Per parameter, in parameters() order: its full shape and the elements
  /// [begin, end) of its full value (row-major) that this rank holds between
  /// steps, which its tensor then is (1-D under a sharded strategy; the
  /// whole, [0, numel), under NoShard). What a sharded save writes and a
  /// sharded load fills.
  struct HeldPiece {
    std::vector<std::int64_t> shape;
    std::size_t begin = 0, end = 0;
  };
  virtual std::vector<HeldPiece> held_pieces() const = 0;
  /// Whether this rank's pieces are the copy a sharded save writes: every
  /// rank's under FullShard and ShardGradOp, the first shard group's under
  /// HybridShard (the others are replicas of it), rank 0's under NoShard.
  virtual bool writes_held() const = 0;

  /// Bytes the unit's gathered parameters hold now: 0 while it is sharded
  /// (freed), the padded unit while gathered.
  virtual std::size_t gathered_bytes() const = 0;

  /// Whether backward reduces the unit's gradients (true) or only adds them
  /// to a full local gradient that the next synced backward reduces.
  virtual bool requires_gradient_sync() const = 0;
  virtual void set_requires_gradient_sync(bool sync) = 0;

  /// The module is gone: the unit is kept only until the registry's next purge.
  bool expired() const noexcept { return module_.expired(); }
  const torch::nn::Module* module() const noexcept { return raw_; }

  /// The communicator the unit was wrapped with (its address: one per
  /// rank), the unit's place among those wrapped with it (alike on every
  /// rank: they wrap in the same order) and its words in errors.
  const void* communicator() const noexcept { return comm_; }
  std::size_t index() const noexcept { return index_; }
  const std::string& description() const noexcept { return description_; }

 protected:
  TorchUnit(const std::shared_ptr<torch::nn::Module>& module, const void* comm, std::size_t index,
            std::string description)
      : module_(module), raw_(module.get()), comm_(comm), index_(index), description_(std::move(description)) {}
  TorchUnit(const TorchUnit&) = delete;
  TorchUnit& operator=(const TorchUnit&) = delete;

 private:
  std::weak_ptr<torch::nn::Module> module_;
  const torch::nn::Module* raw_;
  const void* comm_;
  std::size_t index_;
  std::string description_;
};

/// Every live unit of the process; ranks run as threads share it, hence the lock.
struct TorchUnitRegistry {
  std::mutex mutex;
  std::vector<std::shared_ptr<TorchUnit>> units;
};

inline TorchUnitRegistry& torch_unit_registry() {
  static TorchUnitRegistry registry;
  return registry;
}

/// The unit made for `module`, or null if it was never wrapped.
inline std::shared_ptr<TorchUnit> find_torch_unit(const torch::nn::Module* module) {
  TorchUnitRegistry& r = torch_unit_registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& u : r.units) {
    if (u->module() == module && !u->expired()) return u;
  }
  return nullptr;
}

/// The live unit that holds parameter `p`, or null.
inline std::shared_ptr<TorchUnit> torch_unit_holding(const at::Tensor& p) {
  TorchUnitRegistry& r = torch_unit_registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& u : r.units) {
    if (u->expired()) continue;
    const auto& ps = u->parameters();
    if (std::any_of(ps.begin(), ps.end(), [&](const at::Tensor& q) { return q.is_same(p); })) return u;
  }
  return nullptr;
}

/// The parameters (their TensorImpl) that live units hold, every rank's.
inline std::unordered_set<const void*> torch_unit_held_parameters() {
  TorchUnitRegistry& r = torch_unit_registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  std::unordered_set<const void*> held;
  for (const auto& u : r.units) {
    if (u->expired()) continue;
    for (const at::Tensor& p : u->parameters()) held.insert(p.unsafeGetTensorImpl());
  }
  return held;
}

/// The index the next unit wrapped with `comm` gets: one past the last live one's.
inline std::size_t next_torch_unit_index(const void* comm) {
  TorchUnitRegistry& r = torch_unit_registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  std::size_t next = 0;
  for (const auto& u : r.units) {
    // Expired units are purged by whichever rank wraps next (ranks run as
    // threads share the registry), so counting them could split the ranks.
    if (u->communicator() == comm && !u->expired()) next = std::max(next, u->index() + 1);
  }
  return next;
}

/// The descriptions of the live units wrapped with `comm`, by index (empty
/// where none is alive): how a rank reads a peer's label naming a unit.
inline std::vector<std::string> torch_unit_descriptions(const void* comm) {
  TorchUnitRegistry& r = torch_unit_registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& u : r.units) {
    if (u->communicator() != comm || u->expired()) continue;
    if (out.size() <= u->index()) out.resize(u->index() + 1);
    out[u->index()] = u->description();
  }
  return out;
}

/// The module that `module` holds: `Holder` is a module holder
/// (ShardedModule, a TORCH_MODULE type) or a shared_ptr to a module.
template <class Holder>
std::shared_ptr<torch::nn::Module> module_root(Holder& module) {
  if constexpr (requires { module.ptr(); }) {
    return module.ptr();
  } else {
    return module;
  }
}

/// The units of `module` and of the modules under it, outermost first.
/// `Holder` is a module holder (ShardedModule, TORCH_MODULE) or a shared_ptr.
template <class Holder>
std::vector<std::shared_ptr<TorchUnit>> torch_units_under(Holder& module) {
  const std::shared_ptr<torch::nn::Module> root = module_root(module);
  std::vector<std::shared_ptr<TorchUnit>> out;
  for (const auto& sub : root->modules(/*include_self=*/true)) {
    if (auto unit = find_torch_unit(sub.get())) out.push_back(std::move(unit));
  }
  return out;
}

/// Drops the units of `root` and of the modules under it (their module is
/// about to go: its last holder is being destroyed), so what they hold (a
/// gather in flight, spare buffers, a worker thread) ends now, not at the
/// next fully_shard's purge.
inline void drop_torch_units_under(const torch::nn::Module& root) {
  std::vector<const torch::nn::Module*> under{&root};
  for (const auto& sub : root.modules(/*include_self=*/false)) under.push_back(sub.get());
  TorchUnitRegistry& r = torch_unit_registry();
  std::vector<std::shared_ptr<TorchUnit>> gone;
  {
    const std::lock_guard<std::mutex> lock(r.mutex);
    auto dead = std::stable_partition(r.units.begin(), r.units.end(), [&](const auto& u) {
      return std::find(under.begin(), under.end(), u->module()) == under.end();
    });
    gone.assign(std::make_move_iterator(dead), std::make_move_iterator(r.units.end()));
    r.units.erase(dead, r.units.end());
  }
  // Destroyed outside the lock, as in add_torch_unit.
}

/// Adds `unit`, and drops the units whose module is gone (with them their
/// hold on the module's former parameters).
inline void add_torch_unit(std::shared_ptr<TorchUnit> unit) {
  TorchUnitRegistry& r = torch_unit_registry();
  std::vector<std::shared_ptr<TorchUnit>> gone;
  {
    const std::lock_guard<std::mutex> lock(r.mutex);
    auto dead = std::stable_partition(r.units.begin(), r.units.end(), [](const auto& u) { return !u->expired(); });
    gone.assign(std::make_move_iterator(dead), std::make_move_iterator(r.units.end()));
    r.units.erase(dead, r.units.end());
    r.units.push_back(std::move(unit));
  }
  // Destroyed outside the lock: a unit's destructor touches autograd state.
}

}  // namespace gradsync::detail
