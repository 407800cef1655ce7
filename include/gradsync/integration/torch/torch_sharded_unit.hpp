#pragma once
/// \file detail::TorchShardedUnit: one fully_shard unit of a LibTorch module, its flat shard and its
/// lifecycle (sharded, gathered for forward, gathered for backward, reduce-scattered).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/nn/module.h>

#include "gradsync/collective/all_gather.hpp"
#include "gradsync/collective/all_reduce.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/collective/progress_worker.hpp"
#include "gradsync/collective/reduce_scatter.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/core/ops.hpp"
#include "gradsync/core/request.hpp"
#include "gradsync/core/visit.hpp"
#include "gradsync/integration/torch/fully_shard_options.hpp"
#include "gradsync/integration/torch/parameter_checks.hpp"
#include "gradsync/integration/torch/queue_after_backward.hpp"
#include "gradsync/integration/torch/tensor.hpp"
#include "gradsync/integration/torch/torch_buffer_pool.hpp"
#include "gradsync/integration/torch/torch_gather_scheduler.hpp"
#include "gradsync/integration/torch/torch_unit_names.hpp"
#include "gradsync/integration/torch/torch_unit_registry.hpp"
#include "gradsync/train/common/model.hpp"
#include "gradsync/train/common/step_labels.hpp"
#include "gradsync/train/fsdp/flat_shard.hpp"
#include "gradsync/train/fsdp/hybrid_groups.hpp"
#include "gradsync/train/fsdp/options.hpp"

namespace gradsync::detail {

/// A unit's parameters live in two places. Between steps, each parameter
/// tensor's data is its piece of this rank's flat shard (`shard_`, ⌈P/N⌉
/// elements, 1-D, possibly empty), so an optimizer built on
/// module->parameters() steps on 1/N of the unit. While gathered, each
/// parameter's data is its view of the unit's full flat buffer (`full_`,
/// N·⌈P/N⌉ elements), filled by an AllGather. Tensor::set_data swaps the
/// two without changing the tensor's identity, so the module's field, the
/// optimizer and autograd keep holding the same tensor.
///
/// Freeing the full buffer takes its storage's bytes out but keeps the
/// storage object; gathering again puts bytes under the same object (a
/// freed buffer's from the communicator's TorchBufferPool when one fits).
/// Tensors autograd saved in forward (views of a parameter) hold that
/// object, so they read the re-gathered values in backward.
///
/// When the unit gathers is TorchGatherScheduler's: on the caller's thread
/// when it runs, or ahead by an AllGather on a ProgressWorker (prefetched:
/// the parameters become their full views only when it is used).
///
/// Backward starts for the unit when the gradient of one of its forward's
/// outputs arrives (a tensor hook): the unit is gathered again if freed,
/// and the gradients of the shard are set aside (accumulation). When every
/// trainable parameter's gradient accumulator has run (a post hook), the
/// full gradients are packed into one padded flat buffer, reduce-scattered
/// (averaged) into the shard's gradient, the parameters swapped back to
/// their pieces and given their pieces of it as `.grad`, once the
/// gradients of the forward's inputs are complete too (a hook on each: the
/// unit's backward is over). A callback queued on the autograd engine
/// finishes a unit whose inputs need no gradient, or some of whose
/// parameters got none (zeros stand for them).
template <Backend B>
class TorchShardedUnit final : public TorchUnit, public std::enable_shared_from_this<TorchShardedUnit<B>> {
 public:
  struct Param {
    std::string name;  ///< as the wrapped module's named_parameters() says
    at::Tensor tensor;
    std::vector<std::int64_t> shape;
    bool trainable = false;
    std::size_t offset = 0, count = 0;  ///< in the unit's flat order
    std::size_t lo = 0, len = 0;        ///< its piece of this rank's shard
    at::Tensor full_view, piece, grad_piece, full_grad_view;
    std::shared_ptr<torch::autograd::Node> accumulator;
    std::uintptr_t hook_key = 0;
  };

  /// `index`: the unit's place among those wrapped with `comm` (alike on
  /// every rank); `description`: its words in errors.
  TorchShardedUnit(Communicator<B>& comm, const std::shared_ptr<torch::nn::Module>& module, std::vector<Param> params,
                   std::vector<at::Tensor> buffers, FullyShardOptions options, std::size_t index,
                   std::string description)
      : TorchUnit(module, &comm, index, std::move(description)),
        comm_(comm),
        names_(&comm),
        groups_(comm),
        o_(options),
        params_(std::move(params)),
        buffers_(std::move(buffers)),
        sched_(Scheduler::of(&comm, index == 0)) {
    sched_->add(this);
    for (const Param& p : params_) tensors_.push_back(p.tensor);
    if (!params_.empty()) dtype_ = params_[0].tensor.scalar_type();
    compute_ = o_.param_dtype.value_or(dtype_);
    reduce_ = o_.reduce_dtype.value_or(dtype_);
  }

  ~TorchShardedUnit() override {
    // A prefetch's job holds the tensors it writes, but not past this.
    settle_gather();
    sched_->remove(this);
    for (Param& p : params_) {
      if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
    }
  }

  /// Broadcasts rank 0's values (sync_module_states), lays the unit out,
  /// hooks the gradient accumulators and leaves the unit sharded.
  void init() {
    torch::NoGradGuard no_grad;
    if (o_.sync_module_states && comm_.size() > 1) {
      for (const Param& p : params_) broadcast(p.tensor, LabelPhase::parameters);
      for (const at::Tensor& b : buffers_) broadcast(b, LabelPhase::buffers);
    }
    if (params_.empty()) return;
    // HybridShard: the unit is sharded over groups of shard_size ranks,
    // each group a replica of it (the groups ShardedTrainer makes).
    ShardedTrainerOptions hybrid;
    hybrid.strategy = o_.strategy;
    hybrid.shard_size = o_.shard_size;
    groups_.split(hybrid, where());
    if (Communicator<B>* r = groups_.replica()) replicas_ = r->size();
    const auto n = static_cast<std::size_t>(groups_.shard().size());
    const auto rank = static_cast<std::size_t>(groups_.shard().rank());
    const bool sharded = o_.strategy != ShardingStrategy::NoShard;
    // Each parameter is a member of the one wrapped group, so FlatShard
    // gives its offset in the unit as well as the padding and owned range.
    std::vector<UnitSpec> specs;
    for (const Param& p : params_) {
      TensorSpec t{p.name, {}};
      for (std::int64_t d : p.shape) t.shape.push_back(static_cast<std::size_t>(d));
      specs.push_back({p.name, {t}, {}});
    }
    layout_ = fsdp::FlatShard::make({{0, params_.size() - 1}}, specs, n, sharded);
    const std::size_t c = layout_.chunks[0];
    const auto [first, owned] = layout_.owned_range(0, rank);
    const std::size_t start = sharded ? rank * c : 0;
    start_ = start;
    // HybridShard's shard groups are ranks [0, s), [s, 2s)...: the first is the copy a save writes.
    writes_ = sharded ? comm_.rank() < groups_.shard().size() : comm_.rank() == 0;
    const auto opts = at::TensorOptions().dtype(dtype_);
    full_ = torch::zeros({static_cast<std::int64_t>(sharded ? n * c : c)}, opts);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      p.offset = layout_.member_offset[i];
      p.count = layout_.model_sizes[i];
      p.full_view = full_.narrow(0, as_int(p.offset), as_int(p.count)).view(p.shape);
      p.full_view.copy_(p.tensor);
      const std::size_t a = std::max(p.offset, first), e = std::min(p.offset + p.count, first + owned);
      p.lo = e > a ? a - start : 0;
      p.len = e > a ? e - a : 0;
      p.tensor.set_data(p.full_view);
      p.tensor.mutable_grad().reset();
    }
    if (sharded) {
      shard_ = full_.narrow(0, as_int(start), as_int(c)).clone();
      shard_grad_ = torch::zeros({as_int(c)}, opts);
      for (Param& p : params_) {
        p.piece = shard_.narrow(0, as_int(p.lo), as_int(p.len));
        p.grad_piece = alias(shard_grad_, p.lo, {as_int(p.len)});
      }
    } else {
      full_grad_ = torch::zeros({as_int(c)}, opts);
      for (Param& p : params_) p.full_grad_view = alias(full_grad_, p.offset, p.shape);
    }
    // The accumulators are made while each parameter has its full shape:
    // autograd checks incoming gradients against the shape they record.
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      if (!p.trainable) continue;
      ++trainable_;
      p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
      // After the accumulator ran, the parameter's gradient is final.
      p.hook_key = p.accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak = this->weak_from_this(), i](const torch::autograd::variable_list& outputs,
                                             const torch::autograd::variable_list& /*inputs*/) {
            if (auto unit = weak.lock()) unit->on_gradient(i);
            return outputs;
          }));
    }
    // Mixed precision: the full buffer, gathered into, is of the compute
    // dtype; the accumulators above keep the master dtype's metadata, so
    // autograd casts the gradients they receive to it.
    if (compute_ != dtype_) {
      full_ = torch::zeros({full_.numel()}, full_.options().dtype(compute_));
      for (Param& p : params_) {
        p.full_view = full_.narrow(0, as_int(p.offset), as_int(p.count)).view(p.shape);
        point(p, p.full_view);
      }
    }
    got_.assign(params_.size(), 0);
    gathered_ = true;
    if (sharded) reshard();
  }

  void pre_forward(const std::vector<at::Tensor>& inputs) override {
    for (const Param& p : params_) {
      check_trainable(where(), p.name, p.tensor, p.trainable, "when fully_shard wrapped its module",
                      "which gradients are reduced is fixed when the unit is made: freeze or unfreeze parameters "
                      "before fully_shard");
      // What torch::load put there, the unit would overwrite with its own shard's gather.
      const at::Tensor& given = gathered_ ? p.full_view : p.piece;
      check_data(where(), p.name, p.tensor, given.sizes(), given.data_ptr(), "after fully_shard wrapped its module",
                 "its values would be ignored: load a checkpoint into the module before fully_shard, or with "
                 "gradsync::load_sharded_state_dict after");
    }
    if (compute_ != dtype_) {
      for (const at::Tensor& t : inputs) {
        if (t.defined() && t.is_floating_point() && t.scalar_type() != compute_) {
          const std::string want = c10::toString(compute_);
          throw InvalidArgument(where() + ": an input is " + c10::toString(t.scalar_type()) +
                                " where FullyShardOptions::param_dtype is " + want +
                                ": cast the model's inputs to it (`net(x.to(torch::k" + want + "))`)");
        }
      }
    }
    if (in_backward_) abandon_backward();
    // A callback still marked queued belonged to a backward that threw:
    // the engine drops those callbacks, so the next backward needs its own.
    finish_queued_ = false;
    sched_->before_forward(*this);
    if (!c10::GradMode::is_enabled() || params_.empty()) return;
    std::weak_ptr<TorchShardedUnit> weak = this->weak_from_this();
    for (const at::Tensor& t : inputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      ++inputs_pending_;
      input_hooked_ = true;
      t.register_hook([weak](const at::Tensor& /*grad*/) {
        if (auto unit = weak.lock()) unit->on_input_gradient();
      });
    }
  }

  void post_forward(const std::vector<at::Tensor>& outputs) override {
    bool hooked = false;
    // Frozen parameters need their values in backward too (for the
    // gradient of the unit's input), so every unit hooks its outputs.
    if (c10::GradMode::is_enabled() && !params_.empty()) {
      std::weak_ptr<TorchShardedUnit> weak = this->weak_from_this();
      // Held while the graph is: its end lets a backward that threw end its prefetches.
      std::shared_ptr<void> token = sched_->graph_token();
      for (const at::Tensor& t : outputs) {
        if (!t.defined() || !t.requires_grad()) continue;
        t.register_hook([weak, token](const at::Tensor& /*grad*/) {
          if (auto unit = weak.lock()) unit->pre_backward();
        });
        hooked = true;
      }
    }
    if (o_.strategy != ShardingStrategy::NoShard) {
      // No backward will come for this forward (no_grad, or nothing to
      // train): keeping it gathered would hold the memory until the next one.
      if (o_.strategy != ShardingStrategy::ShardGradOp || !hooked) {
        if (!in_backward_) reshard();
      } else if (in_backward_) {
        kept_ = gathered_;
      } else {
        stash();
      }
    }
    sched_->after_forward(*this);
  }

  void forward_failed() noexcept override { sched_->forward_failed(); }

  const std::vector<at::Tensor>& parameters() const override { return tensors_; }
  const std::vector<at::Tensor>& buffers() const override { return buffers_; }

  std::vector<at::Tensor> full_parameters() override {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> out;
    if (params_.empty()) return out;
    at::Tensor full = full_;
    if (o_.strategy != ShardingStrategy::NoShard) {
      sched_->quiesce();
      full = torch::empty({full_.numel()}, full_.options().dtype(dtype_));
      with_type([&]<class T>(T) {
        AllGather<Auto>{labeled(LabelPhase::gather)}(groups_.shard(), span_of<T>(shard_), span_of<T>(full));
      });
    }
    for (const Param& p : params_) {
      out.push_back(full.narrow(0, as_int(p.offset), as_int(p.count)).view(p.shape).clone());
    }
    return out;
  }

  bool sharded() const override { return o_.strategy != ShardingStrategy::NoShard; }
  int replicas() const override { return replicas_; }

  std::size_t gathered_bytes() const override {
    return full_.defined() ? full_.storage().unsafeGetStorageImpl()->nbytes() : 0;
  }

  /// Its module holds other units, so max_gathered_units does not count it (fully_shard says, before init()).
  void set_encloses(bool encloses) noexcept { encloses_ = encloses; }

  std::vector<HeldPiece> held_pieces() const override {
    std::vector<HeldPiece> out;
    const bool sharded = o_.strategy != ShardingStrategy::NoShard;
    // The rank's shard starts at element start_ of the unit's flat order.
    for (const Param& p : params_) {
      const std::size_t begin = sharded ? (p.len > 0 ? start_ + p.lo - p.offset : 0) : 0;
      out.push_back({p.shape, begin, begin + (sharded ? p.len : p.count)});
    }
    return out;
  }
  bool writes_held() const override { return writes_; }

  bool requires_gradient_sync() const override { return sync_; }
  void set_requires_gradient_sync(bool sync) override { sync_ = sync; }

  std::size_t persistent_bytes() const override {
    if (params_.empty()) return 0;
    const std::size_t elements = o_.strategy == ShardingStrategy::NoShard ? layout_.sizes[0] : layout_.chunks[0];
    return 2 * elements * c10::elementSize(dtype_);
  }

 private:
  using Scheduler = TorchGatherScheduler<TorchShardedUnit>;
  using Worker = ProgressWorker<B>;
  friend Scheduler;

  static std::int64_t as_int(std::size_t v) noexcept { return static_cast<std::int64_t>(v); }

  /// Elements [offset, offset + numel(shape)) of `flat` as a tensor that is
  /// not an autograd view: Optimizer::zero_grad calls detach_() on every
  /// grad, which a view refuses. It keeps `flat` alive.
  static at::Tensor alias(const at::Tensor& flat, std::size_t offset, at::IntArrayRef shape) {
    auto* begin = static_cast<char*>(flat.data_ptr()) + offset * flat.element_size();
    at::Tensor keep = flat;
    return torch::from_blob(
        begin, shape, [keep](void*) mutable { keep.reset(); }, flat.options());
  }

  /// f(T{}) with T the parameters' type (fully_shard accepts float and double).
  template <class F>
  void with_type(F&& f) const {
    if (dtype_ == c10::ScalarType::Double) {
      f(double{});
    } else {
      f(float{});
    }
  }

  /// The collectives' options with this unit's label: ranks whose calls
  /// differ in unit, phase or count of backwards (a forward that skipped a
  /// unit on one rank, a backward more under no_sync) fail on every rank,
  /// naming both, instead of combining unrelated data.
  Options labeled(LabelPhase phase) const {
    Options o = o_.collective;
    o.label = StepLabels::pack(phase, index(), backwards_ + 1);
    o.label.names = &names_;
    return o;
  }

  std::string where() const {
    return "gradsync: fully_shard unit '" + module()->name() + "' on rank " + std::to_string(comm_.rank());
  }

  void broadcast(const at::Tensor& t, LabelPhase phase) {
    if (t.numel() == 0) return;
    visit(*data_type_of(t.scalar_type()), [&]<class T>(T) {
      Broadcast<Auto>{labeled(phase)}(comm_, span_of<T>(t), 0);
    });
  }

  /// Makes `data` the parameter's. Tensor::set_data to another dtype drops
  /// the parameter's gradient accumulator (autograd would make a new one,
  /// unhooked): the unit's, made in the master dtype, is put back.
  void point(Param& p, const at::Tensor& data) {
    p.tensor.set_data(data);
    if (!p.accumulator || compute_ == dtype_) return;
    torch::autograd::AutogradMeta* meta = torch::autograd::impl::get_autograd_meta(p.tensor);
    const std::lock_guard<std::mutex> lock(meta->mutex_);
    meta->grad_accumulator_ = p.accumulator;
  }

  /// Bytes of the full buffer (in the compute dtype) while gathered; 0 when
  /// nothing is ever freed (NoShard, or no parameters).
  std::size_t full_bytes() const noexcept {
    if (params_.empty() || !sharded()) return 0;
    return static_cast<std::size_t>(full_.numel()) * c10::elementSize(compute_);
  }
  /// Gathered, for use or ahead of it (its bytes are there).
  bool holds_gather() const noexcept { return gathered_ || prefetched_ || stashed_; }
  /// What FullyShardOptions::max_gathered_units counts: a gather held by a
  /// unit that encloses no other and is not kept by ShardGradOp.
  bool counts() const noexcept { return holds_gather() && !encloses_ && !kept_ && sharded(); }
  /// Worth gathering ahead: a sharded unit over more than one rank.
  bool can_prefetch() const noexcept { return sharded() && !params_.empty() && groups_.shard().size() > 1; }

  /// The full buffer's storage gets bytes (a spare's when one fits),
  /// filled by an AllGather of every rank's shard: on this thread, the
  /// parameters then their full views; or `ahead`, queued with the same
  /// label on the shard group's worker, holding the tensors it reads and
  /// writes, which the unit waits for before it uses or frees them.
  void gather(bool ahead) {
    torch::NoGradGuard no_grad;
    sched_->pool().fill(*full_.storage().unsafeGetStorageImpl(), full_bytes());
    const at::Tensor shard = compute_ == dtype_ ? shard_ : shard_.to(compute_), full = full_;
    auto job = [shard, full, opts = labeled(LabelPhase::gather), type = *data_type_of(compute_)](Communicator<B>& c) {
      visit(type, [&]<class T>(T) { AllGather<Auto>{opts}(c, span_of<T>(shard), span_of<T>(full)); });
    };
    if (ahead) {
      if (!worker_) {
        worker_ = groups_.shard_is_world() ? sched_->world_worker(comm_) : std::make_shared<Worker>(groups_.shard());
      }
      prefetched_ = true;
      gathering_ = worker_->submit("fully_shard gather of unit " + std::to_string(index()) + " " + description(), job);
      return;
    }
    job(groups_.shard());
    for (Param& p : params_) point(p, p.full_view);
    gathered_ = true;
  }

  /// `t`'s bytes (the full buffer's, or a gradient's) to the pool; its storage object stays (autograd's views).
  void give_bytes(const at::Tensor& t) noexcept {
    sched_->pool().reclaim(*t.storage().unsafeGetStorageImpl(), sched_->held_bytes(), sched_->pool_limit());
  }
  /// Waits for the prefetch in flight (kept when it threw, for settle_gather).
  void wait_gather() {
    gathering_.wait();
    gathering_ = Request();
  }
  void settle_gather() noexcept {
    if (gathering_.valid()) settle(gathering_);
    gathering_ = Request();
  }
  /// A prefetched or stashed unit is used: its parameters become their full views.
  void take_prefetched() {
    if (!prefetched_ && !stashed_) return;
    for (Param& p : params_) point(p, p.full_view);
    prefetched_ = stashed_ = false;
    gathered_ = true;
  }
  /// ShardGradOp after a forward: the full buffer keeps its bytes for the
  /// backward (take_prefetched), but the parameters are their pieces, so an
  /// optimizer step before it steps the shard, never the copy. Where no
  /// backward uses it, the scheduler frees it (drop_stash).
  void stash() {
    if (!gathered_) return;
    for (Param& p : params_) point(p, p.piece);
    gathered_ = false;
    stashed_ = kept_ = true;
  }
  void drop_stash() noexcept {
    if (!stashed_) return;
    stashed_ = kept_ = false;
    give_bytes(full_);
  }
  /// A prefetch never used (its job over) is freed.
  void drop_prefetch() noexcept {
    if (!prefetched_ || gathering_.valid()) return;
    prefetched_ = false;
    give_bytes(full_);
  }

  /// The parameters become their shard pieces and the full buffer's bytes
  /// go back to the pool; a backward prefetch the limit held back may go.
  void reshard() {
    if (!gathered_ || o_.strategy == ShardingStrategy::NoShard) return;
    for (Param& p : params_) point(p, p.piece);
    gathered_ = false;
    kept_ = false;
    give_bytes(full_);
    sched_->freed();
  }

  void queue_finish() {
    if (finish_queued_) return;
    finish_queued_ = true;
    queue_after_backward(*this, &TorchShardedUnit::finish_backward);
  }

  /// The gradient of one of the unit's outputs arrived: its backward is next.
  void pre_backward() {
    if (in_backward_) return;
    queue_finish();
    in_backward_ = true;
    std::fill(got_.begin(), got_.end(), 0);
    got_count_ = 0;
    sched_->before_backward(*this);
    if (o_.strategy == ShardingStrategy::NoShard) return;
    // Autograd accumulates full-shaped gradients into `.grad`: what the
    // shard held (not zeroed, or not reset) is set aside, and added after
    // the reduce-scatter.
    torch::NoGradGuard no_grad;
    accumulate_ = false;
    for (Param& p : params_) {
      if (p.trainable && p.tensor.grad().defined()) accumulate_ = true;
    }
    for (Param& p : params_) {
      if (!p.trainable) continue;
      at::Tensor& g = p.tensor.mutable_grad();
      if (accumulate_) {
        if (!g.defined()) {
          p.grad_piece.zero_();
        } else if (!g.is_same(p.grad_piece)) {
          p.grad_piece.copy_(g.reshape({-1}));
        }
      }
      g.reset();
    }
  }

  void on_gradient(std::size_t i) {
    if (!in_backward_) {
      throw InvalidArgument(where() + ": parameter '" + params_[i].name +
                            "' got a gradient, but the unit's forward output was not seen: call the wrapped module "
                            "through its gradsync::ShardedModule holder (`block(x)`, not `block->forward(x)`), and "
                            "use the parameters only inside that forward");
    }
    if (got_[i]) return;
    got_[i] = 1;
    ++got_count_;
    maybe_post_backward();
  }

  /// A forward while the last backward never finished (it threw): its
  /// partial gradients are dropped and the shard's, set aside, restored.
  void abandon_backward() {
    in_backward_ = false;
    inputs_pending_ = 0;
    input_hooked_ = false;
    restore_set_aside();
  }

  /// Each trainable parameter's `.grad` back to what pre_backward set aside.
  void restore_set_aside() {
    if (o_.strategy == ShardingStrategy::NoShard) return;
    for (Param& p : params_) {
      if (p.trainable) p.tensor.mutable_grad() = accumulate_ ? p.grad_piece : at::Tensor();
    }
  }

  /// The gradient of one of the forward's inputs is complete (every node of the unit's backward to it ran).
  void on_input_gradient() {
    if (inputs_pending_ > 0) --inputs_pending_;
    if (in_backward_) maybe_post_backward();
  }

  /// The unit's backward is over when every trainable parameter has its
  /// gradient and the gradients of its inputs are complete: only then may
  /// the parameters be freed, as later nodes of the unit (a frozen
  /// parameter's product, a parameter used twice) read them. Without an
  /// input that needs a gradient (the first unit), the engine's callback decides.
  void maybe_post_backward() {
    if (got_count_ == trainable_ && input_hooked_ && inputs_pending_ == 0) post_backward();
  }

  void finish_backward() {
    finish_queued_ = false;
    if (in_backward_) post_backward();
  }

  /// Every gradient of the unit is final (or absent, counted as zero):
  /// averaged over the ranks, then the unit goes back to its shard.
  void post_backward() {
    // Counted when done, so this backward's reductions are labelled with it.
    struct Count {
      std::uint64_t& n;
      ~Count() { ++n; }
    } count{backwards_};
    in_backward_ = false;
    inputs_pending_ = 0;
    input_hooked_ = false;
    torch::NoGradGuard no_grad;
    const int n = comm_.size();
    // Every rank has the same trainable parameters (checked at wrap time),
    // so all skip the collective alike.
    if (trainable_ == 0) {
      reshard();
      return;
    }
    if (o_.strategy == ShardingStrategy::NoShard) {
      for (Param& p : params_) {
        if (!p.trainable) continue;
        at::Tensor& g = p.tensor.mutable_grad();
        if (!g.defined()) {
          p.full_grad_view.zero_();
        } else if (!g.is_same(p.full_grad_view)) {
          p.full_grad_view.copy_(g);
        }
        g = p.full_grad_view;
      }
      // Unsynced, the full gradient is this rank's sum so far; the next
      // synced backward averages it (what it held before was alike on every rank).
      if (n > 1 && sync_) {
        sched_->quiesce();
        with_type([&]<class T>(T) {
          AllReduce<Auto>{labeled(LabelPhase::reduce)}(comm_, span_of<T>(full_grad_), Avg{});
        });
      }
      return;
    }
    // Backwards without sync sum the full local gradients here (FSDP's
    // no_sync: the memory of a full gradient, no communication); the next
    // synced backward reduces that sum with its own.
    const bool carried = unsynced_.defined();
    at::Tensor flat = carried ? std::move(unsynced_) : sched_->pool().zeros(full_.numel(), shard_.options());
    unsynced_.reset();
    for (Param& p : params_) {
      const at::Tensor& g = p.tensor.grad();
      if (!p.trainable || !g.defined()) continue;
      at::Tensor slot = flat.narrow(0, as_int(p.offset), as_int(p.count));
      if (carried) {
        slot.add_(g.reshape({-1}));
      } else {
        slot.copy_(g.reshape({-1}));
      }
    }
    if (!sync_) {
      unsynced_ = std::move(flat);
      reshard();
      restore_set_aside();  // the shard's gradient stays what it was
      return;
    }
    at::Tensor out = accumulate_ ? torch::empty({shard_grad_.numel()}, shard_grad_.options()) : shard_grad_;
    Communicator<B>& group = groups_.shard();
    Communicator<B>* replicas = groups_.replica();
    // reduce_dtype: the gradient goes over the wire in it, and back.
    const at::Tensor in = reduce_ == dtype_ ? flat : flat.to(reduce_);
    at::Tensor sum = reduce_ == dtype_ ? out : torch::empty({out.numel()}, out.options().dtype(reduce_));
    if (group.size() > 1 || replicas) sched_->quiesce();
    visit(*data_type_of(reduce_), [&]<class T>(T) {
      if (group.size() == 1) {
        sum.copy_(in);
      } else {
        // HybridShard sums in the group and across the replicas, then
        // divides once by the world size (as ShardedTrainer's reduce_unit).
        if (replicas) {
          ReduceScatter<Auto>{labeled(LabelPhase::reduce)}(group, span_of<T>(in), span_of<T>(sum), Sum{});
        } else {
          ReduceScatter<Auto>{labeled(LabelPhase::reduce)}(group, span_of<T>(in), span_of<T>(sum), Avg{});
        }
      }
      if (replicas && replicas->size() > 1) {
        AllReduce<Auto>{labeled(LabelPhase::replica_reduce)}(*replicas, span_of<T>(sum), Sum{});
      }
    });
    if (!sum.is_same(out)) out.copy_(sum);
    if (replicas) out.div_(n);
    if (accumulate_) shard_grad_.add_(out);
    give_bytes(flat);
    reshard();
    for (Param& p : params_) {
      if (p.trainable) p.tensor.mutable_grad() = p.grad_piece;
    }
  }

  Communicator<B>& comm_;
  TorchUnitNames names_;
  /// The unit's shard group (comm_ itself but under HybridShard) and replicas.
  fsdp::HybridGroups<Communicator<B>> groups_;
  int replicas_ = 1;
  FullyShardOptions o_;
  std::vector<Param> params_;
  std::vector<at::Tensor> tensors_;  ///< params_' tensors, for parameters()
  std::vector<at::Tensor> buffers_;
  c10::ScalarType dtype_ = c10::ScalarType::Float;    ///< the parameters' (the masters')
  c10::ScalarType compute_ = c10::ScalarType::Float;  ///< param_dtype: gathered in
  c10::ScalarType reduce_ = c10::ScalarType::Float;   ///< reduce_dtype: reduced in
  fsdp::FlatShard layout_;
  at::Tensor full_, shard_, shard_grad_, full_grad_;
  at::Tensor unsynced_;  ///< the full local gradient summed by backwards without sync, if any
  std::size_t trainable_ = 0, got_count_ = 0, inputs_pending_ = 0;
  std::uint64_t backwards_ = 0;  ///< backwards the unit finished, synced or not
  std::vector<unsigned char> got_;
  bool gathered_ = false, in_backward_ = false, finish_queued_ = false, accumulate_ = false, input_hooked_ = false;
  bool sync_ = true;
  /// Gathered ahead and not used yet; kept by ShardGradOp from forward to backward (stash()); its module holds others.
  bool prefetched_ = false, kept_ = false, stashed_ = false, encloses_ = false;
  /// The units of this communicator: when each gathers, and the spare bytes.
  std::shared_ptr<Scheduler> sched_;
  /// The prefetch in flight, and the worker it runs on (after groups_, whose shard group it may use).
  Request gathering_;
  std::shared_ptr<ProgressWorker<B>> worker_;
  std::size_t start_ = 0;  ///< the first element of the unit's flat order this rank's shard holds
  bool writes_ = false;    ///< writes_held()
};

}  // namespace gradsync::detail
