#pragma once
/// \file DistributedDataParallel: PyTorch's DDP for a LibTorch torch::nn::Module, on any host gradsync communicator.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
// nn::Module, not all of <torch/torch.h> (about half the time to parse).
#include <torch/nn/module.h>

#include "gradsync/algorithm/tags.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/float16.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"
#include "gradsync/core/visit.hpp"
#include "gradsync/integration/torch/device_communicator.hpp"
#include "gradsync/integration/torch/device_grad_sync.hpp"
#include "gradsync/integration/torch/distributed_data_parallel_options.hpp"
#include "gradsync/integration/torch/graph_reach.hpp"
#include "gradsync/integration/torch/parameter_checks.hpp"
#include "gradsync/integration/torch/tensor.hpp"
#include "gradsync/integration/torch/torch_grad_syncs.hpp"
#include "gradsync/train/ddp/grad_sync.hpp"
#include "gradsync/train/ddp/grad_sync_options.hpp"
#include "gradsync/train/ddp/no_sync_guard.hpp"
#include "gradsync/train/common/on_nonfinite.hpp"
#include "gradsync/train/common/unit_agreement.hpp"

namespace gradsync {

/// Data parallelism for a LibTorch module: what torch.nn.parallel.DistributedDataParallel does in Python, which
/// LibTorch's C++ frontend lacks (pytorch/pytorch#48959).
///
///     Net net;                                              // TORCH_MODULE
///     gradsync::DistributedDataParallel ddp(comm, net);     // broadcasts rank 0's weights
///     torch::optim::SGD opt(net->parameters(), 0.1);
///     opt.zero_grad();
///     auto loss = torch::nll_loss(ddp(x), y);              // net->forward(x)
///     loss.backward();                                      // returns with averaged gradients
///     opt.step();
///
/// How: every parameter's `.grad` is a view into one flat gradient buffer
/// (PyTorch's gradient_as_bucket_view), so buckets are reduced in place. A
/// hook after each parameter's gradient accumulator marks it ready in a
/// GradSync, which launches each bucket (reverse registration order, 1 MiB
/// first, then 25 MiB) on the communicator's progress worker while backward
/// goes on; a callback on the autograd engine finishes the sync before
/// `backward()` returns, so the training loop is unchanged.
///
/// The averaged gradient is then checked for NaN and Inf
/// (DistributedDataParallelOptions::on_nonfinite): by default backward()
/// throws gradsync::Error on every rank, naming the step and the first such
/// parameter, with the gradients zeroed. Under skip_step it zeroes them and
/// returns; step the optimizer through `ddp.step(opt)`, which skips it then:
///
///     loss.backward();
///     ddp.step(opt);                                        // opt.step() unless non-finite
///
/// Construction is collective: every rank must wrap the same parameters and
/// buffers (names, shapes, dtypes, which parameters are frozen, in the same
/// order), else InvalidArgument on every rank naming the first difference;
/// then rank 0's parameters, frozen ones included, and buffers are broadcast,
/// as PyTorch's DDP does. Parameters that require a gradient must be
/// contiguous CPU tensors of one floating dtype (float, double, bfloat16 or
/// half), the flat gradient's; the error names a parameter that breaks
/// this, mixes dtypes or later changes shape.
///
/// Frozen parameters (requires_grad false at construction) are broadcast
/// then, never reduced or hooked. Which are frozen is fixed at construction,
/// as PyTorch DDP's buckets are: a forward after one was frozen or unfrozen
/// throws InvalidArgument naming it (build a new DistributedDataParallel).
///
/// bfloat16 and half gradients are reduced as they are, with no float copy:
/// each addition widens to float and rounds back to 16 bits; a bfloat16 sum
/// is divided by N once, half gradients before the sum (whose range half
/// would overflow). They match one process on the N·b batch to the 16-bit
/// type's precision, not bitwise; every rank gets the same bits.
///
/// CPU backward runs the hooks and the final callback on the calling thread:
/// one DistributedDataParallel belongs to one thread (rank), as its communicator.
///
/// CUDA tensors: pass a DeviceCommunicator (torch_device_communicator wraps a
/// Communicator<Nccl> in a CUDA translation unit; device_communicator.hpp
/// says why). Parameters, buffers and the flat gradient are on its device;
/// the hooks run on the engine's thread for it. Each bucket is enqueued on
/// the communicator's stream after an event on the gradient stream
/// (DistributedDataParallelOptions::cuda_stream); finish makes that stream
/// wait for the reductions and waits for them on the host within the
/// deadline, as do buffer broadcasts in a forward.
///
/// A backward that throws leaves the buckets it launched to end when its
/// graph goes (or at the next forward, if the caller keeps the graph),
/// after which `zero_grad` and the next step train as if it never ran.
///
/// \tparam Module  a module holder (`torch::nn::Linear`, a TORCH_MODULE type)
///                 or a `std::shared_ptr` to a torch::nn::Module subclass.
/// \tparam Comm    gradsync::Communicator<Backend> over host memory (Threads, Mpi),
///                 or gradsync::DeviceCommunicator (CUDA tensors, on Nccl).
/// \tparam Algo    the algorithm of every collective (on a DeviceCommunicator,
///                 the one it was made with: torch_device_communicator<Algo>).
template <class Module, class Comm, class Algo = Auto>
class DistributedDataParallel {
  static constexpr bool on_device = std::is_same_v<Comm, DeviceCommunicator>;
  static_assert(on_device || detail::CommunicatorTraits<Comm>::value,
                "gradsync::DistributedDataParallel: the second parameter must be gradsync::Communicator<Backend> "
                "or gradsync::DeviceCommunicator");
  static_assert(on_device || !detail::CommunicatorTraits<Comm>::value || detail::host_communicator<Comm>(),
                "gradsync::DistributedDataParallel takes a Communicator<Backend> over host memory (Threads, Mpi) "
                "for CPU tensors. For CUDA tensors on Nccl, wrap the Communicator<Nccl> with "
                "gradsync::torch_device_communicator (gradsync/integration/torch/nccl_device_communicator.hpp, "
                "in a CUDA translation unit) and pass that DeviceCommunicator.");

 public:
  using module_type = Module;
  using communicator_type = Comm;

  DistributedDataParallel(Comm& comm, Module module, DistributedDataParallelOptions options = {})
      : comm_(comm), module_(std::move(module)), o_(options), state_(std::make_shared<HookState>()) {
    state_->owner = this;
    collect();
    check_agreement();
    make_grad_views();
    make_sync();
    {
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> all;
      for (const Named& p : every_param_) all.push_back(p.tensor);
      for (auto& b : base().named_buffers(true)) all.push_back(b.value());
      broadcast(all);
    }
    register_hooks();
  }
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Removes the hooks (the module outlives this object) and lets what is in flight end.
  ~DistributedDataParallel() {
    state_->owner = nullptr;
    for (Param& p : params_) {
      if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
    }
    if constexpr (on_device) {
      // A backward that failed half-way may have left buckets reading the flat gradient freed below.
      try {
        comm_.join(o_.cuda_stream);
      } catch (...) {
        // Its error is the communicator's, and resurfaces at its next use.
      }
    }
  }

  /// The forward pass: checks that no parameter changed shape, storage or requires_grad,
  /// broadcasts rank 0's buffers (DistributedDataParallelOptions::broadcast_buffers), then
  /// calls `module->forward(args...)`. With find_unused_parameters, a Tensor result's graph
  /// is walked where grad is enabled, as PyTorch DDP does: parameters it cannot reach are marked
  /// ready (zeros) as soon as backward starts, so their buckets do not wait for finish().
  template <class... Args>
  auto operator()(Args&&... args) {
    check_parameters();
    // A backward that failed never ran its final callback: start clean, GradSync's ready units too.
    if (std::exchange(finish_queued_, false)) std::visit([](auto& s) { s->abandon(); }, sync_);
    std::fill(got_.begin(), got_.end(), 0);
    // PyTorch 1.13, torch/nn/parallel/distributed.py, forward(): buffers are
    // synced before the module runs when require_forward_param_sync, which
    // starts true and is set after every forward to
    // `torch.is_grad_enabled() and self.require_backward_grad_sync`.
    if (o_.broadcast_buffers && broadcast_buffers_next_ && comm_.size() > 1) {
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> buffers;
      for (auto& b : base().named_buffers(true)) buffers.push_back(b.value());
      broadcast(buffers);
    }
    auto out = module_->forward(std::forward<Args>(args)...);
    broadcast_buffers_next_ = c10::GradMode::is_enabled() && sync_enabled();
    if constexpr (std::is_same_v<decltype(out), torch::Tensor>) {
      if (o_.find_unused_parameters && c10::GradMode::is_enabled()) find_unreachable(out);  // as PyTorch's DDP
      // Freed with this forward's graph: if its backward threw (its callback
      // never ran), what it launched ends then, before a zero_grad it would race.
      if (out.requires_grad()) out.register_hook([token = graph_token()](const torch::Tensor&) {});
    }
    return out;
  }

  Module& module() noexcept { return module_; }
  const Module& module() const noexcept { return module_; }

  /// While the guard lives, backward only accumulates gradients locally; the
  /// next synced backward averages the sum (PyTorch's `no_sync()`). Every
  /// rank must run as many backwards under it before a synced one: on a host
  /// communicator a rank that ran one more fails the next sync on every rank,
  /// naming both counts ("sync 3", "sync 4"), where PyTorch's DDP would
  /// average gradients of different steps.
  using NoSync = detail::NoSyncGuard<DistributedDataParallel>;
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  bool sync_enabled() const {
    return std::visit([](const auto& s) { return s->sync_enabled(); }, sync_);
  }
  void set_sync(bool on) {
    std::visit([on](auto& s) { s->set_sync(on); }, sync_);
  }

  /// Bucket statistics: `buckets_launched_early` counts those started while backward ran.
  const GradSyncStats& stats() const {
    return std::visit([](const auto& s) -> const GradSyncStats& { return s->stats(); }, sync_);
  }
  void reset_stats() {
    std::visit([](auto& s) { s->reset_stats(); }, sync_);
  }
  /// The bucket plan: which parameters (by registration index) go together.
  const std::vector<BucketInfo>& buckets() const {
    return std::visit([](const auto& s) -> const std::vector<BucketInfo>& { return s->buckets(); }, sync_);
  }
  /// Whether the last synced backward's averaged gradient was finite; after
  /// one that was not (gradients zeroed; under throw_error it also threw),
  /// false until the next, alike on every rank. step() skips the optimizer then.
  bool step_is_finite() const noexcept { return finite_; }

  /// `optimizer.step()` unless the last synced backward was non-finite
  /// (step_is_finite()), as torch.cuda.amp.GradScaler::step: so a skipped
  /// step leaves the optimizer's state (momentum, Adam's moments and step
  /// count) as it was. Returns whether the optimizer stepped.
  template <class Optimizer>
  bool step(Optimizer& optimizer) {
    if (!finite_) return false;
    optimizer.step();
    return true;
  }

  /// Synced backwards non-finite under OnNonfinite::skip_step (the steps step() skipped).
  std::size_t skipped_steps() const noexcept { return skipped_; }

  /// Names of the parameters that are synchronised, in registration order.
  std::vector<std::string> parameter_names() const {
    std::vector<std::string> out;
    for (const Param& p : params_) out.push_back(p.name);
    return out;
  }

 private:
  struct Param {
    std::string name;
    torch::Tensor tensor;
    std::vector<std::int64_t> shape;
    void* data = nullptr;
    std::size_t offset = 0;  ///< in the flat gradient, in elements
    torch::Tensor grad_view;
    std::shared_ptr<torch::autograd::Node> accumulator;
    std::uintptr_t hook_key = 0;
  };

  /// What the hooks point at: the hooks live in the autograd graph, which
  /// may outlive this object; they find it through here, or find nothing.
  struct HookState {
    DistributedDataParallel* owner = nullptr;
  };

  class ReadyHook final : public torch::autograd::FunctionPostHook {
   public:
    ReadyHook(std::shared_ptr<HookState> state, std::size_t index) : state_(std::move(state)), index_(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list& /*inputs*/) override {
      if (state_->owner) state_->owner->on_gradient(index_);
      return outputs;
    }

   private:
    std::shared_ptr<HookState> state_;
    std::size_t index_;
  };

  torch::nn::Module& base() {
    if constexpr (requires { module_.ptr(); }) {
      return *module_.ptr();
    } else {
      return *module_;
    }
  }

  static bool is_floating(c10::ScalarType t) noexcept {
    return t == c10::ScalarType::Float || t == c10::ScalarType::Double || t == c10::ScalarType::BFloat16 ||
           t == c10::ScalarType::Half;
  }

  std::string where() const { return "gradsync: DistributedDataParallel on rank " + std::to_string(comm_.rank()); }

  void collect() {
    for (auto& np : base().named_parameters(true)) {
      const torch::Tensor& t = np.value();
      every_param_.push_back({np.key(), t});
      requires_grad_.push_back(t.requires_grad());
      if (!t.requires_grad()) {
        // Frozen: neither reduced nor hooked, as in PyTorch DDP, but broadcast.
        if (std::string why = unusable_reason(t); !why.empty()) {
          throw InvalidArgument(where() + ": frozen parameter '" + np.key() + "' cannot be broadcast from rank 0: " +
                                why);
        }
        continue;
      }
      if (std::string why = unusable_reason(t); !why.empty()) {
        throw InvalidArgument(where() + ": parameter '" + np.key() + "' cannot be synchronised: " + why);
      }
      if (!is_floating(t.scalar_type())) {
        throw InvalidArgument(where() + ": parameter '" + np.key() + "' is " + c10::toString(t.scalar_type()) +
                              "; gradients are averaged in float, double, bfloat16 or half");
      }
      if (!params_.empty() && t.scalar_type() != params_.front().tensor.scalar_type()) {
        throw InvalidArgument(where() + ": parameter '" + np.key() + "' is " + c10::toString(t.scalar_type()) +
                              " but '" + params_.front().name + "' is " +
                              c10::toString(params_.front().tensor.scalar_type()) +
                              "; all parameters must share one dtype, the flat gradient's (cast the module with "
                              "module->to(dtype), or keep the parameters of other dtypes frozen)");
      }
      Param p;
      p.name = np.key();
      p.tensor = t;
      p.shape = t.sizes().vec();
      p.data = t.data_ptr();
      params_.push_back(std::move(p));
    }
    if (params_.empty()) {
      throw InvalidArgument(where() + ": the module has no parameter that requires a gradient; there is nothing "
                                      "to synchronise");
    }
  }

  /// Every rank wrapped the same parameters and buffers: checked before any data
  /// moves, so a mismatch is an error on every rank, not one tensor broadcast into another.
  void check_agreement() {
    std::vector<std::string> declared;
    auto describe = [](const std::string& kind, const std::string& name, const torch::Tensor& t) {
      return kind + " " + name + " " + c10::toString(t.scalar_type()) + " " + c10::str(t.sizes());
    };
    // Ranks that differ here would part at the first non-finite step, one throwing, another stepping.
    declared.push_back(std::string("on_nonfinite ") + name(o_.on_nonfinite));
    for (const Named& p : every_param_) {
      declared.push_back(describe(p.tensor.requires_grad() ? "parameter" : "frozen parameter", p.name, p.tensor));
    }
    for (auto& b : base().named_buffers(true)) {
      if (std::string why = unusable_reason(b.value()); !why.empty()) {
        throw InvalidArgument(where() + ": buffer '" + b.key() + "' cannot be broadcast: " + why);
      }
      declared.push_back(describe("buffer", b.key(), b.value()));
    }
    constexpr std::string_view fix =
        "Every rank must wrap the same module: the same parameters and buffers, with the same names, dtypes and "
        "shapes, in the same order, and the same parameters frozen (requires_grad false), with the same "
        "DistributedDataParallelOptions::on_nonfinite.";
    if constexpr (on_device) {
      comm_.check_agree(declared, "DistributedDataParallel", fix);
    } else {
      detail::check_units_agree(comm_, declared, "DistributedDataParallel", fix);
    }
  }

  /// One flat gradient buffer in registration order; each parameter's .grad aliases its
  /// slice, made with from_blob (holding the buffer alive), not as an autograd view:
  /// LibTorch's Optimizer::zero_grad calls detach_() on every grad, which a view refuses.
  void make_grad_views() {
    std::size_t total = 0;
    for (Param& p : params_) {
      p.offset = total;
      total += static_cast<std::size_t>(p.tensor.numel());
    }
    const auto options = p_options();
    flat_grad_ = torch::zeros({static_cast<std::int64_t>(total)}, options);
    torch::NoGradGuard no_grad;
    for (Param& p : params_) {
      auto* begin = static_cast<char*>(flat_grad_.data_ptr()) + p.offset * flat_grad_.element_size();
      torch::Tensor keep = flat_grad_;
      p.grad_view = torch::from_blob(
          begin, p.shape, [keep](void*) mutable { keep.reset(); }, options);
      if (p.tensor.grad().defined()) p.grad_view.copy_(p.tensor.grad());
      p.tensor.mutable_grad() = p.grad_view;
    }
  }

  c10::TensorOptions p_options() const {
    return torch::TensorOptions().dtype(params_.front().tensor.scalar_type()).device(device());
  }

  /// Where this rank's tensors must be: the CPU, or the communicator's GPU.
  torch::Device device() const {
    if constexpr (on_device) {
      return {torch::kCUDA, static_cast<c10::DeviceIndex>(comm_.device())};
    } else {
      return torch::kCPU;
    }
  }

  /// Why `t` cannot take part (as a parameter or buffer), or empty.
  std::string unusable_reason(const torch::Tensor& t) const {
    if constexpr (on_device) {
      if (!t.defined()) return "it is undefined";
      if (t.device() != device()) {
        return "it is on " + t.device().str() + ", and this rank's communicator works on " + device().str() +
               (t.device().is_cuda() ? "" : " (move the module there with module->to(device))");
      }
      if (!t.is_contiguous()) return "it is not contiguous (call .contiguous() on it, or make the module's tensors contiguous)";
      if (!data_type_of(t.scalar_type())) return std::string("its dtype ") + c10::toString(t.scalar_type()) +
                                                 " has no gradsync element type (float, double, int32, int64, bfloat16, half)";
      return {};
    } else {
      return detail::unusable_reason(t);
    }
  }

  void make_sync() {
    GradSyncOptions g;
    g.bucket_cap_bytes = o_.bucket_cap_bytes;
    g.first_bucket_cap_bytes = o_.first_bucket_cap_bytes;
    g.find_unused_parameters = o_.find_unused_parameters;
    g.collective = o_.collective;
    if constexpr (on_device) {
      std::vector<std::size_t> counts;
      for (const Param& p : params_) counts.push_back(static_cast<std::size_t>(p.tensor.numel()));
      // Runs on the autograd thread inside finish(): the zeros go on the
      // gradient stream (the current one), before the final launches wait for it.
      auto zero = [this](std::size_t i) {
        torch::NoGradGuard no_grad;
        params_[i].grad_view.zero_();
      };
      sync_ = std::make_unique<detail::DeviceGradSync>(comm_, *data_type_of(flat_grad_.scalar_type()),
                                                       flat_grad_.data_ptr(), counts, g, zero, o_.cuda_stream);
      return;
    } else {
      make_host_sync(g);
    }
  }

  void make_host_sync(const GradSyncOptions& g) {
    std::vector<std::string> names = parameter_names();
    auto build = [&]<class T>(T) {
      std::vector<std::span<T>> units;
      for (const Param& p : params_) units.push_back(tensor_span<T>(p.grad_view, p.name));
      using B = typename detail::CommunicatorTraits<Comm>::backend;
      auto sync = std::make_unique<GradSync<B, T, Algo>>(comm_, std::move(units), g, std::move(names));
      sync->set_check_finite(o_.on_nonfinite != OnNonfinite::ignore);
      sync_ = std::move(sync);
    };
    switch (flat_grad_.scalar_type()) {
      case c10::ScalarType::Double: build(double{}); break;
      case c10::ScalarType::BFloat16: build(bfloat16{}); break;
      case c10::ScalarType::Half: build(float16{}); break;
      default: build(float{}); break;
    }
  }

  /// Rank 0's values of `ts` everywhere; each passed unusable_reason at construction.
  void broadcast(const std::vector<torch::Tensor>& ts) {
    if (comm_.size() == 1) return;
    if constexpr (on_device) {
      comm_.wait_for(o_.cuda_stream);
      for (const torch::Tensor& t : ts) {
        if (t.numel() != 0) {
          comm_.broadcast(t.data_ptr(), static_cast<std::size_t>(t.numel()), *data_type_of(t.scalar_type()), 0);
        }
      }
      comm_.join(o_.cuda_stream);
    } else {
      for (const torch::Tensor& t : ts) {
        if (t.numel() == 0) continue;
        visit(*data_type_of(t.scalar_type()), [&]<class T>(T) {
          Broadcast<Algo>{o_.collective}(comm_, detail::span_of<T>(t), 0);
        });
      }
    }
  }

  void register_hooks() {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      // The accumulator is held here: the parameter keeps only a weak
      // reference, and a new one (without our hook) would replace it.
      p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
      p.hook_key = p.accumulator->add_post_hook(std::make_unique<ReadyHook>(state_, i));
    }
    got_.assign(params_.size(), 0);
    touched_.assign(params_.size(), 0);
  }

  void check_parameters() const {
    for (std::size_t i = 0; i < every_param_.size(); ++i) {
      detail::check_trainable(where(), every_param_[i].name, every_param_[i].tensor, requires_grad_[i],
                              "when DistributedDataParallel was built",
                              "which gradients are averaged is fixed at construction, as in PyTorch's DDP. Destroy "
                              "this DistributedDataParallel and construct a new one over the module after freezing "
                              "or unfreezing parameters");
    }
    for (const Param& p : params_) {
      detail::check_data(where(), p.name, p.tensor, p.shape, p.data, "after DistributedDataParallel was built",
                         "its gradient can no longer be synchronised");
    }
  }

  /// After parameter i's gradient accumulator ran: its gradient for this backward is final.
  void on_gradient(std::size_t i) {
    Param& p = params_[i];
    torch::Tensor& g = p.tensor.mutable_grad();
    // The grad was reset (zero_grad with set_to_none, or by hand) and autograd
    // made a fresh tensor: bring it back into the bucket.
    if (!g.defined() || g.data_ptr() != p.grad_view.data_ptr()) {
      torch::NoGradGuard no_grad;
      if (g.defined()) {
        p.grad_view.copy_(g);
      } else {
        p.grad_view.zero_();
      }
      g = p.grad_view;
    }
    if (!finish_queued_) {
      // The first gradient of this backward. The engine runs the callback
      // after the whole backward, before backward() returns; an exception
      // it throws reaches backward()'s caller.
      finish_queued_ = true;
      backward_of_ = forwards_;
      std::shared_ptr<HookState> state = state_;
      torch::autograd::Engine::get_default_engine().queue_callback([state] {
        if (state->owner) state->owner->finish_backward();
      });
      if (sync_enabled()) mark_unreachable_ready();
    }
    if (got_[i] && sync_enabled()) {
      throw InvalidArgument(where() + ": parameter '" + p.name +
                            "' got a gradient after being marked unused: the graph of the forward through this "
                            "DistributedDataParallel did not reach it, so it was used outside that forward");
    }
    got_[i] = 1;
    touched_[i] = 1;
    std::visit([i](auto& s) { s->ready(i); }, sync_);
  }

  /// What forward()'s graph holds: when it goes while a backward of it is
  /// open (it threw), GradSync lets what it launched end and forgets it.
  std::shared_ptr<void> graph_token() {
    return std::shared_ptr<void>(nullptr, [state = state_, forward = ++forwards_](void*) noexcept {
      DistributedDataParallel* d = state->owner;
      if (!d || !d->finish_queued_ || d->backward_of_ != forward) return;
      d->finish_queued_ = false;
      std::visit([](auto& s) { s->abandon(); }, d->sync_);
    });
  }

  /// Parameters the last forward's graph cannot reach: ready now, holding
  /// zeros, or what they accumulated under no_sync.
  void mark_unreachable_ready() {
    for (std::size_t i : unreachable_) {
      if (!touched_[i]) {
        torch::NoGradGuard no_grad;
        params_[i].grad_view.zero_();
      }
      got_[i] = 1;
      std::visit([i](auto& s) { s->ready(i); }, sync_);
    }
    unreachable_.clear();
  }

  void find_unreachable(const torch::Tensor& out) {
    unreachable_.clear();
    const auto seen = detail::graph_reach(out);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!seen.contains(params_[i].accumulator.get())) unreachable_.push_back(i);
    }
  }

  void finish_backward() {
    finish_queued_ = false;
    const bool synced = sync_enabled();
    std::string missing;
    if (synced && !o_.find_unused_parameters) {
      for (std::size_t i = 0; i < params_.size(); ++i) {
        if (!got_[i]) missing += (missing.empty() ? "'" : ", '") + params_[i].name + "'";
      }
    }
    std::fill(got_.begin(), got_.end(), 0);
    if (!missing.empty()) {
      // GradSync refuses this backward too, after letting what is in flight
      // end; its message speaks of units, ours of the module's parameters.
      try {
        std::visit([](auto& s) { s->finish(); }, sync_);
      } catch (const InvalidArgument&) {
      }
      std::fill(touched_.begin(), touched_.end(), 0);
      throw InvalidArgument(where() + ": backward produced no gradient for parameter " + missing +
                            ". If the module leaves some parameters unused on some steps, set "
                            "DistributedDataParallelOptions::find_unused_parameters = true");
    }
    std::vector<std::int32_t> used;
    if (synced && o_.find_unused_parameters) used.assign(touched_.begin(), touched_.end());
    if (synced) std::fill(touched_.begin(), touched_.end(), 0);
    std::visit([](auto& s) { s->finish(); }, sync_);
    if (!used.empty()) attach_unused_grads(used);
    if (synced) check_finite();
  }

  /// After a synced backward under find_unused_parameters (`used`: what this rank's backwards reached since the
  /// last sync): a grad left undefined (set_to_none) of a parameter some rank used becomes the bucket's view, the
  /// average, or this rank's optimizer would skip what the others step; one no rank used stays undefined, as in
  /// PyTorch's DDP (one all-reduce of a flag per parameter; on a device, of host flags through device memory).
  void attach_unused_grads(std::vector<std::int32_t>& used) {
    if constexpr (on_device) {
      if (comm_.size() > 1) comm_.max_flags(std::span<std::int32_t>(used));
    } else if (comm_.size() > 1) {
      AllReduce<Algo>{}(comm_, std::span<std::int32_t>(used), Max{});
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      torch::Tensor& g = params_[i].tensor.mutable_grad();
      if (used[i] && (!g.defined() || g.data_ptr() != params_[i].grad_view.data_ptr())) g = params_[i].grad_view;
    }
  }

  /// After a synced backward: its averaged gradient, the same on every
  /// rank, checked as DistributedDataParallelOptions::on_nonfinite says.
  void check_finite() {
    ++synced_;
    finite_ = true;
    if (o_.on_nonfinite == OnNonfinite::ignore) return;
    const std::optional<std::size_t> bad = first_nonfinite();
    if (!bad) return;
    finite_ = false;
    {
      torch::NoGradGuard no_grad;
      flat_grad_.zero_();
    }
    if (o_.on_nonfinite == OnNonfinite::skip_step) {
      ++skipped_;
      return;
    }
    throw Error(where() + ": step " + std::to_string(synced_) +
                " (synced backwards are counted) went non-finite: the averaged gradient of parameter '" +
                params_[*bad].name +
                "' holds a NaN or an Inf. Every rank's gradients were zeroed: do not step the optimizer on them. "
                "Look for a learning rate too high or a bad batch, or set DistributedDataParallelOptions::"
                "on_nonfinite = OnNonfinite::skip_step and step through ddp.step(optimizer) to skip such steps.");
  }

  /// The first parameter (registration order) whose averaged gradient
  /// holds a NaN or an Inf: GradSync's scan on the host; on the device a
  /// reduction of the whole gradient, then, only when it fails, one per
  /// parameter to name it.
  std::optional<std::size_t> first_nonfinite() {
    if constexpr (on_device) {
      torch::NoGradGuard no_grad;
      if (torch::isfinite(flat_grad_).all().template item<bool>()) return std::nullopt;
      for (std::size_t i = 0; i < params_.size(); ++i) {
        if (!torch::isfinite(params_[i].grad_view).all().template item<bool>()) return i;
      }
      return std::nullopt;
    } else {
      return std::visit([](const auto& s) { return s->first_nonfinite_unit(); }, sync_);
    }
  }

  /// A parameter of the module, trainable or frozen.
  struct Named {
    std::string name;
    torch::Tensor tensor;
  };

  Comm& comm_;
  Module module_;
  DistributedDataParallelOptions o_;
  std::shared_ptr<HookState> state_;
  std::vector<Named> every_param_;  ///< every parameter, in registration order
  std::vector<bool> requires_grad_;  ///< every_param_'s flags at construction
  std::vector<Param> params_;        ///< those that require a gradient
  torch::Tensor flat_grad_;
  typename detail::TorchGradSyncs<Comm, Algo>::type sync_;
  bool finish_queued_ = false;
  std::uint64_t forwards_ = 0, backward_of_ = 0;  ///< forwards so far; the one whose backward is open
  /// Synced backwards since construction: the step an error names.
  std::size_t synced_ = 0;
  /// See step_is_finite().
  bool finite_ = true;
  std::size_t skipped_ = 0;
  /// The next forward broadcasts rank 0's buffers (PyTorch's require_forward_param_sync).
  bool broadcast_buffers_next_ = true;
  std::vector<unsigned char> got_;      ///< got a gradient in this backward
  std::vector<unsigned char> touched_;  ///< got one since the last synced backward
  std::vector<std::size_t> unreachable_;
};

}  // namespace gradsync
