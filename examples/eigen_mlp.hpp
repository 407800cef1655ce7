#pragma once
// An MLP classifier for gradsync's trainers: ReLU hidden layers, softmax
// cross-entropy, its math in Eigen. Its parameters live in the trainer's
// flat storage; a step lends the model a layer's views through its
// gradsync::StepContext, and the model keeps none (gradsync::Model).
//
// Shared by examples/ddp_mlp.cpp and bench/ddp_step.cpp. BasicEigenMlp<bfloat16>
// computes in bfloat16 (its compute_type): the trainer lends it bfloat16
// parameters and takes bfloat16 gradients, while its arithmetic is float's, one
// layer widened at a time, as a CPU without bfloat16 units does it.

// First: its pragma reaches the intrinsics header only if nothing included it before.
#include "eigen_dense.hpp"

#include <gradsync/train/common/model.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace example {

/// `count` samples: features column by column (sample i at x + i * dim) and labels.
struct Batch {
  const float* x = nullptr;
  const int* labels = nullptr;
  int count = 0;
};

/// \tparam C  the element type of the parameters and gradients a step sees:
///            float, or gradsync::bfloat16 (float arithmetic on them).
template <class C = float>
class BasicEigenMlp {
 public:
  using value_type = float;
  using compute_type = C;
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic>;
  using MatrixMap = Eigen::Map<Matrix>;
  using VectorMap = Eigen::Map<Eigen::VectorXf>;

  /// Layer widths, input first, classes last: {784, 1024, 1024, 10}.
  explicit BasicEigenMlp(std::vector<int> sizes, std::uint64_t seed) : sizes_(std::move(sizes)), seed_(seed) {}

  std::vector<gradsync::UnitSpec> units() const {
    std::vector<gradsync::UnitSpec> u;
    for (std::size_t l = 0; l + 1 < sizes_.size(); ++l) {
      const auto in = static_cast<std::size_t>(sizes_[l]), out = static_cast<std::size_t>(sizes_[l + 1]);
      u.push_back({"fc" + std::to_string(l + 1), {{"weight", {out, in}}, {"bias", {out}}}, {}});
    }
    return u;
  }

  /// Writes layer l's He-uniform initial weights (zero biases). The trainer
  /// calls it for layers 0, 1, ... in order, so one generator runs across
  /// them; unit by unit, a ShardedTrainer holds one layer in full at a time
  /// while it builds its shards. Keeps no views: a step reaches the weights
  /// through its gradsync::StepContext.
  void init_unit(std::size_t l, const gradsync::UnitView<float>& unit) {
    if (l == 0) rng_.seed(seed_);
    const float bound = std::sqrt(6.0f / static_cast<float>(sizes_[l]));
    std::uniform_real_distribution<float> dist(-bound, bound);
    for (float& w : unit.params[0].value) w = dist(rng_);
    for (float& b : unit.params[1].value) b = 0.0f;
  }

  std::size_t parameter_count() const {
    std::size_t n = 0;
    for (std::size_t l = 0; l + 1 < sizes_.size(); ++l) n += std::size_t(sizes_[l + 1]) * std::size_t(sizes_[l] + 1);
    return n;
  }

  /// Mean cross-entropy over the batch; adds its gradient into the grad
  /// views and reports each layer ready as soon as its gradient is final.
  double forward_backward(const Batch& batch, const gradsync::StepContext<C>& ctx) {
    const int n = batch.count;
    const std::size_t L = layers();
    forward(batch, ctx);
    // Scored here, from the forward pass the step needs anyway: a training
    // accuracy that costs no second pass.
    last_correct_ = right(acts_[L], batch);
    // Softmax probabilities become dLoss/dlogits in place: (p - onehot) / n.
    Matrix& delta = acts_[L];
    double loss = 0;
    for (int i = 0; i < n; ++i) {
      const int y = batch.labels[i];
      loss -= std::log(std::max(delta(y, i), 1e-30f));
      delta(y, i) -= 1.0f;
    }
    delta *= 1.0f / static_cast<float>(n);
    for (std::size_t l = L; l-- > 0;) {
      const auto in = sizes_[l], out = sizes_[l + 1];
      const Matrix& d = l + 1 == L ? acts_[L] : deltas_[l + 1];
      const Eigen::Ref<const Matrix> a = input(l, n);
      const auto p = ctx.params(l);
      if constexpr (std::is_same_v<C, float>) {
        MatrixMap gw(p->params[0].grad.data(), out, in);
        VectorMap gb(p->params[1].grad.data(), out);
        gw.noalias() += d * a.transpose();
        gb.noalias() += d.rowwise().sum();
      } else {
        // In float, then added into the bfloat16 gradient, rounded once.
        scratch_.resize(std::size_t(out) * std::size_t(in + 1));
        MatrixMap gw(scratch_.data(), out, in);
        VectorMap gb(scratch_.data() + std::size_t(out) * std::size_t(in), out);
        gw.noalias() = d * a.transpose();
        gb.noalias() = d.rowwise().sum();
        add_rounded(p->params[0].grad, scratch_.data());
        add_rounded(p->params[1].grad, gb.data());
      }
      ctx.ready(l);
      if (l > 0) {
        // Through the weights, then the ReLU: zero where the activation was.
        const auto w = weights(*p, l);
        deltas_[l].noalias() = w.transpose() * d;
        deltas_[l].array() *= (a.array() > 0.0f).cast<float>();
      }
    }
    return loss / n;
  }

  /// Number of samples in `batch` classified correctly; `ctx` from the
  /// trainer's evaluate().
  int correct(const Batch& batch, const gradsync::StepContext<C>& ctx) {
    forward(batch, ctx);
    return right(acts_[layers()], batch);
  }

  /// How many samples the last forward_backward() classified correctly, before its update.
  int last_correct() const { return last_correct_; }

 private:
  /// Samples whose highest probability (a column of `p`) is their label.
  static int right(const Matrix& p, const Batch& batch) {
    int ok = 0;
    for (int i = 0; i < batch.count; ++i) {
      Eigen::Index arg;
      p.col(i).maxCoeff(&arg);
      ok += static_cast<int>(arg) == batch.labels[i];
    }
    return ok;
  }

  /// Layer l's input: the batch itself for l = 0 (no copy), else acts_[l].
  Eigen::Ref<const Matrix> input(std::size_t l, int n) const {
    if (l == 0) return Eigen::Map<const Matrix>(x_, sizes_[0], n);
    return acts_[l];
  }

  std::size_t layers() const { return sizes_.size() - 1; }

  /// Layer l's weights as a float matrix: the view itself, or (bfloat16)
  /// its values widened into one layer's scratch, with the bias after them.
  Eigen::Map<const Matrix> weights(const gradsync::UnitView<C>& unit, std::size_t l) {
    const auto in = sizes_[l], out = sizes_[l + 1];
    if constexpr (std::is_same_v<C, float>) {
      return {unit.params[0].value.data(), out, in};
    } else {
      wide_.resize(std::size_t(out) * std::size_t(in + 1));
      float* w = wide_.data();
      for (const C x : unit.params[0].value) *w++ = static_cast<float>(x);
      for (const C x : unit.params[1].value) *w++ = static_cast<float>(x);
      return {wide_.data(), out, in};
    }
  }
  /// Layer l's bias, after weights(unit, l).
  Eigen::Map<const Eigen::VectorXf> bias(const gradsync::UnitView<C>& unit, std::size_t l) const {
    const auto in = sizes_[l], out = sizes_[l + 1];
    if constexpr (std::is_same_v<C, float>) {
      return {unit.params[1].value.data(), out};
    } else {
      return {wide_.data() + std::size_t(out) * std::size_t(in), out};
    }
  }

  /// grad += float values, rounded to C once per element.
  static void add_rounded(std::span<C> grad, const float* values) {
    for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = C(static_cast<float>(grad[i]) + values[i]);
  }

  void forward(const Batch& batch, const gradsync::StepContext<C>& ctx) {
    const int n = batch.count;
    const std::size_t L = layers();
    acts_.resize(sizes_.size());
    deltas_.resize(sizes_.size());
    x_ = batch.x;
    for (std::size_t l = 0; l < L; ++l) {
      const auto p = ctx.params(l);
      const auto w = weights(*p, l);
      const auto b = bias(*p, l);
      acts_[l + 1].noalias() = w * input(l, n);
      acts_[l + 1].colwise() += b;
      if (l + 1 < L) acts_[l + 1] = acts_[l + 1].cwiseMax(0.0f);
    }
    Matrix& z = acts_[L];
    for (int i = 0; i < n; ++i) {
      const float m = z.col(i).maxCoeff();
      z.col(i) = (z.col(i).array() - m).exp().matrix();
      z.col(i) /= z.col(i).sum();
    }
  }

  std::vector<int> sizes_;
  std::uint64_t seed_;
  std::mt19937_64 rng_;  // init_unit's, across the layers
  const float* x_ = nullptr;
  int last_correct_ = 0;
  // acts_[l]: the output of layer l-1, after ReLU (acts_[0] unused: the
  // batch is read in place); deltas_[l]: dLoss/d that output before ReLU.
  // Each keeps its size from step to step: a step resizes none of them.
  std::vector<Matrix> acts_, deltas_;
  // bfloat16 only: one layer's weights and bias widened to float, and one
  // layer's gradient in float before it is rounded (the model's, like its
  // activations: not counted in a trainer's memory_need).
  std::vector<float> wide_, scratch_;
};

using EigenMlp = BasicEigenMlp<float>;

}  // namespace example
