#pragma once
/// \file The named tensors of a training state: the name, dtype and shape
/// under which each piece of a trainer's storage, its optimizer's state and
/// its counters is saved, and where each piece lives in flat storage.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradsync/checkpoint/tensor_dtype.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/train/data/distributed_sampler.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/optim/optimizer.hpp"

namespace gradsync::detail {

/// Which flat array a saved tensor's values come from.
enum class StateSource : std::uint8_t { parameter, buffer, optimizer };

/// One tensor of a training state: as the file declares it, and the
/// elements [offset, offset + count) of the flat array that holds it.
/// Parameters and optimizer buffers index the flat parameters (an optimizer
/// steps that span, so its buffers line up with it); buffers index the flat
/// buffers.
struct StateTensor {
  checkpoint::TensorInfo info;
  StateSource source = StateSource::parameter;
  std::size_t offset = 0;
  std::size_t count = 0;
  /// For StateSource::optimizer: which of OptimizerStateView::buffers.
  std::size_t buffer = 0;
};

/// `unit.tensor`, the name PyTorch's state_dict gives a module's tensor.
inline std::string state_name(const UnitSpec& unit, const TensorSpec& tensor) {
  return unit.name.empty() ? tensor.name : unit.name + "." + tensor.name;
}

/// The tensors of `units` and of an optimizer with per-element buffers
/// `optimizer_buffers`, unit by unit (a sharded writer can gather and write
/// one unit at a time): `fc1.weight`, `fc1.bias`, the unit's buffers, then
/// `optimizer.fc1.weight.exp_avg`, `optimizer.fc1.weight.exp_avg_sq`, ...
/// Element type T; shapes are the units' full logical shapes.
template <class T>
std::vector<StateTensor> state_tensors(const std::vector<UnitSpec>& units,
                                       std::span<const std::string_view> optimizer_buffers) {
  const checkpoint::TensorDtype dtype = checkpoint::tensor_dtype_of<T>;
  auto info = [&](std::string name, const TensorSpec& t) {
    return checkpoint::TensorInfo{std::move(name), dtype, std::vector<std::uint64_t>(t.shape.begin(), t.shape.end())};
  };
  std::vector<StateTensor> out;
  std::size_t p = 0, b = 0;
  for (const UnitSpec& u : units) {
    std::size_t q = p;
    for (const TensorSpec& t : u.params) {
      out.push_back({info(state_name(u, t), t), StateSource::parameter, q, t.count(), 0});
      q += t.count();
    }
    for (const TensorSpec& t : u.buffers) {
      out.push_back({info(state_name(u, t), t), StateSource::buffer, b, t.count(), 0});
      b += t.count();
    }
    for (const TensorSpec& t : u.params) {
      for (std::size_t k = 0; k < optimizer_buffers.size(); ++k) {
        out.push_back({info("optimizer." + state_name(u, t) + "." + std::string(optimizer_buffers[k]), t),
                       StateSource::optimizer, p, t.count(), k});
      }
      p += t.count();
    }
  }
  return out;
}

/// A number of a training state (a counter, a hyper-parameter, a flag),
/// saved as a 0-dimensional tensor so that it is typed and checksummed like
/// the rest, and numpy reads it as it is.
struct StateScalar {
  std::string name;
  checkpoint::TensorDtype dtype = checkpoint::TensorDtype::U64;
  std::array<std::byte, 8> bytes{};

  static StateScalar counter(std::string name, std::uint64_t v) {
    return {std::move(name), checkpoint::TensorDtype::U64, std::bit_cast<std::array<std::byte, 8>>(v)};
  }
  static StateScalar real(std::string name, double v) {
    return {std::move(name), checkpoint::TensorDtype::F64, std::bit_cast<std::array<std::byte, 8>>(v)};
  }
  static StateScalar flag(std::string name, bool v) {
    StateScalar s{std::move(name), checkpoint::TensorDtype::BOOL, {}};
    s.bytes[0] = std::byte{v ? std::uint8_t{1} : std::uint8_t{0}};
    return s;
  }

  std::uint64_t as_counter() const noexcept { return std::bit_cast<std::uint64_t>(bytes); }
  double as_real() const noexcept { return std::bit_cast<double>(bytes); }
  bool as_flag() const noexcept { return bytes[0] != std::byte{0}; }

  checkpoint::TensorInfo info() const { return {name, dtype, {}}; }
  std::span<const std::byte> data() const noexcept { return {bytes.data(), checkpoint::dtype_size(dtype)}; }
  std::span<std::byte> data() noexcept { return {bytes.data(), checkpoint::dtype_size(dtype)}; }
};

/// Where each group of StateScalars starts in state_scalars' list.
struct ScalarIndex {
  static constexpr std::size_t trainer_step = 0;
  static constexpr std::size_t optimizer_step = 1;
  static constexpr std::size_t first_hyperparameter = 2;
};

/// The scalars of a training state, in this order: `trainer.step`,
/// `optimizer.step`, `optimizer.<hyper-parameter>` for each (F64), and with
/// a sampler `sampler.seed`, `sampler.epoch`, `sampler.consumed`,
/// `sampler.length` (U64), `sampler.shuffle`, `sampler.drop_last` (BOOL).
template <class T>
std::vector<StateScalar> state_scalars(std::uint64_t trainer_steps, const OptimizerStateView<T>& opt,
                                       const SamplerState* sampler) {
  std::vector<StateScalar> s;
  s.push_back(StateScalar::counter("trainer.step", trainer_steps));
  s.push_back(StateScalar::counter("optimizer.step", opt.steps));
  for (const auto& [name, value] : opt.hyperparameters) s.push_back(StateScalar::real("optimizer." + std::string(name), value));
  if (sampler) {
    s.push_back(StateScalar::counter("sampler.seed", sampler->seed));
    s.push_back(StateScalar::counter("sampler.epoch", sampler->epoch));
    s.push_back(StateScalar::counter("sampler.consumed", sampler->consumed));
    s.push_back(StateScalar::counter("sampler.length", sampler->length));
    s.push_back(StateScalar::flag("sampler.shuffle", sampler->shuffle));
    s.push_back(StateScalar::flag("sampler.drop_last", sampler->drop_last));
  }
  return s;
}

/// The sampler's part of state_scalars' list, which starts at `first`.
inline SamplerState sampler_state_of(std::span<const StateScalar> s, std::size_t first) {
  return {s[first].as_counter(),     s[first + 1].as_counter(), s[first + 2].as_counter(),
          s[first + 3].as_counter(), s[first + 4].as_flag(),    s[first + 5].as_flag()};
}

}  // namespace gradsync::detail
