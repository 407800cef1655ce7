#pragma once
// An MLP classifier for gradsync's trainers: ReLU hidden layers, softmax
// cross-entropy, its math in Eigen. Its parameters live in the trainer's
// flat storage; the model only keeps views of it (gradsync::Model).
//
// Shared by examples/ddp_mlp.cpp and bench/ddp_step.cpp.

#include <gradsync/train/model.hpp>

#include <Eigen/Dense>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace example {

/// `count` samples: features column by column (sample i at x + i * dim) and labels.
struct Batch {
  const float* x = nullptr;
  const int* labels = nullptr;
  int count = 0;
};

class EigenMlp {
 public:
  using value_type = float;
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic>;
  using MatrixMap = Eigen::Map<Matrix>;
  using VectorMap = Eigen::Map<Eigen::VectorXf>;

  /// Layer widths, input first, classes last: {784, 1024, 1024, 10}.
  explicit EigenMlp(std::vector<int> sizes, std::uint64_t seed) : sizes_(std::move(sizes)), seed_(seed) {}

  std::vector<gradsync::UnitSpec> units() const {
    std::vector<gradsync::UnitSpec> u;
    for (std::size_t l = 0; l + 1 < sizes_.size(); ++l) {
      const auto in = static_cast<std::size_t>(sizes_[l]), out = static_cast<std::size_t>(sizes_[l + 1]);
      u.push_back({"fc" + std::to_string(l + 1), {{"weight", {out, in}}, {"bias", {out}}}, {}});
    }
    return u;
  }

  /// Keeps the views and writes He-uniform initial weights (zero biases).
  void bind(std::span<const gradsync::UnitView<float>> units) {
    views_.assign(units.begin(), units.end());
    std::mt19937_64 rng(seed_);
    for (std::size_t l = 0; l < views_.size(); ++l) {
      const float bound = std::sqrt(6.0f / static_cast<float>(sizes_[l]));
      std::uniform_real_distribution<float> dist(-bound, bound);
      for (float& w : views_[l].params[0].value) w = dist(rng);
      for (float& b : views_[l].params[1].value) b = 0.0f;
    }
    acts_.resize(sizes_.size());
  }

  std::size_t parameter_count() const {
    std::size_t n = 0;
    for (const auto& u : views_) n += u.flat_params.size();
    return n;
  }

  /// Mean cross-entropy over the batch; adds its gradient into the grad
  /// views and reports each layer ready as soon as its gradient is final.
  double forward_backward(const Batch& batch, const gradsync::GradsReady& ready) {
    const int n = batch.count;
    const std::size_t L = views_.size();
    forward(batch);
    Matrix& p = acts_[L];  // softmax probabilities, overwritten by delta
    double loss = 0;
    for (int i = 0; i < n; ++i) {
      const int y = batch.labels[i];
      loss -= std::log(std::max(p(y, i), 1e-30f));
      p(y, i) -= 1.0f;
    }
    p *= 1.0f / static_cast<float>(n);
    delta_ = p;
    for (std::size_t l = L; l-- > 0;) {
      const auto in = sizes_[l], out = sizes_[l + 1];
      MatrixMap gw(views_[l].params[0].grad.data(), out, in);
      VectorMap gb(views_[l].params[1].grad.data(), out);
      const Matrix& a = acts_[l];
      gw.noalias() += delta_ * a.transpose();
      gb.noalias() += delta_.rowwise().sum();
      ready(l);
      if (l > 0) {
        MatrixMap w(views_[l].params[0].value.data(), out, in);
        back_.noalias() = w.transpose() * delta_;
        delta_ = back_.cwiseProduct((a.array() > 0.0f).cast<float>().matrix());
      }
    }
    return loss / n;
  }

  /// Number of samples in `batch` classified correctly.
  int correct(const Batch& batch) {
    forward(batch);
    const Matrix& p = acts_[views_.size()];
    int ok = 0;
    for (int i = 0; i < batch.count; ++i) {
      Eigen::Index arg;
      p.col(i).maxCoeff(&arg);
      ok += static_cast<int>(arg) == batch.labels[i];
    }
    return ok;
  }

 private:
  void forward(const Batch& batch) {
    const int n = batch.count;
    const std::size_t L = views_.size();
    acts_[0] = Eigen::Map<const Matrix>(batch.x, sizes_[0], n);
    for (std::size_t l = 0; l < L; ++l) {
      const auto in = sizes_[l], out = sizes_[l + 1];
      MatrixMap w(views_[l].params[0].value.data(), out, in);
      VectorMap b(views_[l].params[1].value.data(), out);
      acts_[l + 1].noalias() = w * acts_[l];
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
  std::vector<gradsync::UnitView<float>> views_;
  std::vector<Matrix> acts_;
  Matrix delta_, back_;
};

}  // namespace example
