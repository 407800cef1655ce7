#pragma once
/// \file What a model gives a trainer: its parameter shapes, grouped into
/// units, and a forward/backward that writes into trainer-owned storage.
///
/// The trainer owns every parameter, gradient and buffer as one flat array
/// each, with each unit a contiguous range of it, in the order the model
/// declares. The model keeps no views: in a step it asks for a unit
/// (StepContext::params) and gets views (std::span) valid while it holds
/// the handle. A replicated trainer can then all-reduce a range of units in
/// place; a sharded one can keep a 1/N slice of a unit and gather it on
/// demand; an optimizer steps on any flat span.

#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsync/core/bfloat16.hpp"

namespace gradsync {

/// One named tensor: a parameter (trained, has a gradient) or a buffer
/// (state such as running statistics, broadcast but never reduced).
struct TensorSpec {
  std::string name;
  std::vector<std::size_t> shape;

  /// Elements: the product of the shape (1 for a scalar's empty shape).
  std::size_t count() const noexcept {
    std::size_t n = 1;
    for (std::size_t d : shape) n *= d;
    return n;
  }
};

/// A unit (usually a layer): the granularity at which gradients become
/// ready during backward and, for a sharded trainer, at which parameters
/// are gathered.
struct UnitSpec {
  std::string name;
  std::vector<TensorSpec> params;
  std::vector<TensorSpec> buffers;
};

/// A parameter's value and gradient, or a buffer's value (grad empty):
/// views into the trainer's flat storage.
template <class T>
struct TensorView {
  std::span<T> value;
  std::span<T> grad;
  const TensorSpec* spec = nullptr;
};

/// One unit's views, and its whole contiguous range in the flat storage.
template <class T>
struct UnitView {
  std::vector<TensorView<T>> params;
  std::vector<TensorView<T>> buffers;
  std::span<T> flat_params;
  std::span<T> flat_grads;
  std::span<T> flat_buffers;
};

namespace detail {

/// What a trainer lends a step's context: a unit's views while the model
/// holds them (acquire/release), and the report that its gradients are final.
template <class T>
class UnitProvider {
 public:
  virtual const UnitView<T>& acquire(std::size_t unit) = 0;
  virtual void release(std::size_t unit) noexcept = 0;
  virtual void ready(std::size_t unit) = 0;

 protected:
  UnitProvider() = default;
  UnitProvider(const UnitProvider&) = default;
  UnitProvider& operator=(const UnitProvider&) = default;
  ~UnitProvider() = default;
};

}  // namespace detail

/// A unit's parameters (and gradients, and buffers) held by the model: the
/// views are valid while the handle lives, and the trainer may free or
/// reshard them once it goes. Get one from StepContext::params.
template <class T>
class UnitParams {
 public:
  UnitParams(detail::UnitProvider<T>& provider, std::size_t unit)
      : provider_(&provider), unit_(unit), view_(&provider.acquire(unit)) {}
  UnitParams(UnitParams&& other) noexcept
      : provider_(std::exchange(other.provider_, nullptr)), unit_(other.unit_), view_(other.view_) {}
  UnitParams(const UnitParams&) = delete;
  UnitParams& operator=(const UnitParams&) = delete;
  UnitParams& operator=(UnitParams&&) = delete;
  ~UnitParams() {
    if (provider_) provider_->release(unit_);
  }

  const UnitView<T>& operator*() const noexcept { return *view_; }
  const UnitView<T>* operator->() const noexcept { return view_; }
  std::size_t unit() const noexcept { return unit_; }

 private:
  detail::UnitProvider<T>* provider_;
  std::size_t unit_;
  const UnitView<T>* view_;
};

/// Passed to the model's forward_backward: the only way to a unit's
/// parameters during a step, and the report that a unit's gradients are
/// final. In forward the model holds `auto p = ctx.params(u)` while it
/// reads unit u; in backward it asks again, adds its gradients into
/// `p->params[i].grad`, and calls `ctx.ready(u)` while still holding it, as
/// soon as they are final, so the trainer can reduce them while backward
/// goes on. A replicated trainer lends its own storage (a virtual call); a
/// sharded one gathers the unit on the first ask and frees it per strategy.
template <class T>
class StepContext {
 public:
  explicit StepContext(detail::UnitProvider<T>& provider) : provider_(&provider) {}

  /// Unit `unit`'s views, valid until the handle goes.
  [[nodiscard]] UnitParams<T> params(std::size_t unit) const { return UnitParams<T>(*provider_, unit); }
  /// Unit `unit`'s gradients are final for this backward.
  void ready(std::size_t unit) const { provider_->ready(unit); }

 private:
  detail::UnitProvider<T>* provider_;
};

namespace detail {
template <class M>
concept ModelHasValueType = requires { typename M::value_type; } && std::floating_point<typename M::value_type>;

/// The element type a model computes in: `M::compute_type` where it
/// declares one, else its value_type.
template <class M>
struct ComputeType {
  using type = typename M::value_type;
};
template <class M>
  requires requires { typename M::compute_type; }
struct ComputeType<M> {
  using type = typename M::compute_type;
};
template <class M>
using compute_t = typename ComputeType<M>::type;

/// A compute_type, if declared, is the value_type or bfloat16.
template <class M>
concept ModelComputeType = ModelHasValueType<M> && (std::same_as<compute_t<M>, typename M::value_type> ||
                                                     std::same_as<compute_t<M>, bfloat16>);

template <class M>
concept ModelDeclaresUnits = requires(const M& m) {
  { m.units() } -> std::convertible_to<std::vector<UnitSpec>>;
};
template <class M>
concept ModelBinds = ModelHasValueType<M> && requires(M& m, std::span<const UnitView<typename M::value_type>> v) {
  m.bind(v);
};
template <class M>
concept ModelInitsUnits = ModelHasValueType<M> && requires(M& m, const UnitView<typename M::value_type>& v) {
  m.init_unit(std::size_t{}, v);
};
template <class M>
concept ModelWritesInitialValues = ModelBinds<M> || ModelInitsUnits<M>;

/// Has the model write its initial values into `views` (one per unit, in
/// declaration order): unit by unit if it can, else all at once.
template <class M>
void write_initial_values(M& model, std::span<const UnitView<typename M::value_type>> views) {
  if constexpr (ModelInitsUnits<M>) {
    for (std::size_t u = 0; u < views.size(); ++u) model.init_unit(u, views[u]);
  } else {
    model.bind(views);
  }
}
}  // namespace detail

/// A model a trainer can own:
/// - `using value_type = float;` (or double): the element type of its
///   storage: of its master parameters, which the optimizer steps, and of
///   the views its initial values are written into;
/// - optionally `using compute_type = gradsync::bfloat16;`: the element type
///   of the views its steps see (StepContext<compute_type>), value_type if
///   not declared. A model that computes in bfloat16 sees bfloat16
///   parameters rounded from the value_type master and writes bfloat16
///   gradients, which the trainer adds into value_type ones as each unit
///   is ready: ReplicatedTrainer (and NoShard) keeps bfloat16 copies of
///   all of them; ShardedTrainer's sharded strategies gather each unit in
///   bfloat16 (FSDP's param_dtype). Both trainers refuse such a model if
///   it has buffers;
/// - `std::vector<UnitSpec> units() const`: its parameters and buffers,
///   grouped into units, in forward order;
/// - its initial values, written by one of
///   - `void init_unit(std::size_t u, const UnitView<value_type>& view)`:
///     unit u's. A trainer calls it once per unit, in declaration order
///     (0, 1, ...), so the model may draw from one generator across units.
///     A sharded trainer then needs only one wrapped unit in full at a time
///     while it builds its shards;
///   - `void bind(std::span<const UnitView<value_type>>)`: every unit's at
///     once. A sharded trainer then holds the whole model's parameters once,
///     at construction (MemoryNeed::construction).
///
///   A model with both is initialised by init_unit. Each rank may write
///   different values: a trainer replaces them with rank 0's. The views are
///   valid only during the call (their gradient views may be empty): a
///   model must not keep them, and reaches its parameters in a step through
///   StepContext::params (a sharded trainer holds them only in shards).
/// Its forward/backward is checked separately, per batch type (TrainableOn).
template <class M>
concept Model = detail::ModelHasValueType<M> && detail::ModelComputeType<M> && detail::ModelDeclaresUnits<M> &&
                detail::ModelWritesInitialValues<M> && std::move_constructible<M>;

/// A model that can train on `Batch`: `double forward_backward(const Batch&,
/// const StepContext<compute_type>&)` runs forward and backward, holding each
/// unit's parameters through `ctx.params(u)` while it uses them, adds (+=)
/// the gradient of its mean loss into the grad views, calls `ctx.ready(u)`
/// once per unit in every backward, a unit without parameters too (nothing
/// to add, but the trainers check that no unit was forgotten; only
/// ReplicatedTrainer's find_unused_parameters lets a unit it did not use go
/// without), and returns the loss.
template <class M, class Batch>
concept TrainableOn =
    Model<M> && requires(M& m, const Batch& b, const StepContext<detail::compute_t<M>>& ctx) {
      { m.forward_backward(b, ctx) } -> std::convertible_to<double>;
    };

}  // namespace gradsync
