#pragma once
/// \file What a model gives a trainer: its parameter shapes, grouped into
/// units, and a forward/backward that writes into trainer-owned storage.
///
/// The trainer owns every parameter, gradient and buffer as one flat array
/// each, with each unit a contiguous range of it, in the order the model
/// declares. The model only holds views (std::span) into those arrays. A
/// replicated trainer can then all-reduce a range of units in place; a
/// sharded one can keep a 1/N slice of a unit and gather it on demand; an
/// optimizer steps on any flat span.

#include <concepts>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

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

/// Passed to the model's backward; it calls `ready(unit)` as soon as that
/// unit's gradients are final for this backward, so the trainer can start
/// reducing them while backward goes on. A plain function reference, so a
/// model need not be a template.
class GradsReady {
 public:
  explicit GradsReady(std::function<void(std::size_t)> fn) : fn_(std::move(fn)) {}
  void operator()(std::size_t unit) const { fn_(unit); }

 private:
  std::function<void(std::size_t)> fn_;
};

namespace detail {
template <class M>
concept ModelHasValueType = requires { typename M::value_type; } && std::floating_point<typename M::value_type>;
template <class M>
concept ModelDeclaresUnits = requires(const M& m) {
  { m.units() } -> std::convertible_to<std::vector<UnitSpec>>;
};
template <class M>
concept ModelBinds = ModelHasValueType<M> && requires(M& m, std::span<const UnitView<typename M::value_type>> v) {
  m.bind(v);
};
}  // namespace detail

/// A model a trainer can own:
/// - `using value_type = float;` (or double): the element type of its storage;
/// - `std::vector<UnitSpec> units() const`: its parameters and buffers,
///   grouped into units, in forward order;
/// - `void bind(std::span<const UnitView<value_type>>)`: keeps the views and
///   writes initial values (each rank may write different ones; a trainer
///   replaces them with rank 0's).
/// Its forward/backward is checked separately, per batch type (TrainableOn).
template <class M>
concept Model = detail::ModelHasValueType<M> && detail::ModelDeclaresUnits<M> && detail::ModelBinds<M> &&
                std::move_constructible<M>;

/// A model that can train on `Batch`: `double forward_backward(const Batch&,
/// const GradsReady&)` runs forward and backward, adds (+=) the gradient of
/// its mean loss into the grad views, calls `ready(u)` once per unit that
/// received a gradient, and returns the loss.
template <class M, class Batch>
concept TrainableOn = Model<M> && requires(M& m, const Batch& b, const GradsReady& ready) {
  { m.forward_backward(b, ready) } -> std::convertible_to<double>;
};

}  // namespace gradsync
