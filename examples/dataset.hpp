#pragma once
// The Eigen examples' data: a built-in synthetic classification set (784
// features, 10 classes, nonlinear boundaries) or IDX files (data_source.hpp),
// and the batch and test loops over them. Shared by examples/ddp_mlp.cpp and
// examples/fsdp_mlp.cpp.

// First: its pragma reaches the intrinsics header only if nothing included it before.
#include "eigen_dense.hpp"
#include "eigen_mlp.hpp"

#include "data_source.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace example {

/// splitmix64: the same stream on every platform and standard library, so
/// every process of an MPI run builds the very same data.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : s_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, n).
  int below(int n) { return static_cast<int>((next() >> 11) % static_cast<std::uint64_t>(n)); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// Standard normal (Box–Muller).
  float normal() {
    const double u = 1.0 - uniform(), v = uniform();
    return static_cast<float>(std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v));
  }
  /// Roughly normal, mean 0 and variance 1, from one draw: the sum of four
  /// 16-bit uniforms (Irwin–Hall), cheap enough for every pixel.
  float noise() {
    const std::uint64_t r = next();
    const float s = static_cast<float>((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48));
    return (s * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
  }

 private:
  std::uint64_t s_;
};

/// Built-in data: 784 features, 10 classes, 5% of labels replaced by a
/// random class. A 3-dimensional latent cube is cut into 100 Voronoi cells,
/// ten per class, scattered, so classes interleave across nonlinear
/// boundaries. A sample is a uniform point of the cube labelled by its
/// cell; its features are that point, jittered, seen through a random
/// two-layer tanh network as 784 values, plus noise on each. The default
/// run learns it over several epochs: test accuracy about 59% after the
/// first, 85% after the sixth; a classifier that knew the cells would score
/// about 88% (set in `ceiling`). Every process of a run builds the same
/// data from the same seed.
inline void synthetic(Dataset& train, Dataset& test, std::size_t train_samples, std::size_t test_samples,
               std::uint64_t seed) {
  constexpr int latent = 3, cells = 100, hidden = 64, dim = 784, classes = 10;
  constexpr float jitter = 0.02f, pixel_noise = 0.1f;
  constexpr double label_noise = 0.05;
  Rng rng(seed);
  auto random = [&](int rows, int cols, float scale) {
    Eigen::MatrixXf m(rows, cols);
    for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = scale * rng.normal();
    return m;
  };
  // Cell k's centre is sites.col(k); it belongs to class k % 10.
  Eigen::MatrixXf sites(latent, cells);
  for (Eigen::Index i = 0; i < sites.size(); ++i) sites.data()[i] = static_cast<float>(2 * rng.uniform() - 1);
  const Eigen::MatrixXf a1 = random(hidden, latent, 1.5f / std::sqrt(float(latent)));
  const Eigen::MatrixXf a2 = random(dim, hidden, 1.5f / std::sqrt(float(hidden)));
  const Eigen::VectorXf b1 = random(hidden, 1, 0.5f), b2 = random(dim, 1, 0.5f);
  auto cell_class = [&](const Eigen::VectorXf& z) {
    Eigen::Index k;
    (sites.colwise() - z).colwise().squaredNorm().minCoeff(&k);
    return static_cast<int>(k % classes);
  };
  auto fill = [&](Dataset& d, std::size_t n) {
    d.dim = dim;
    d.classes = classes;
    d.y.resize(n);
    Eigen::MatrixXf z(latent, static_cast<Eigen::Index>(n));
    std::size_t knowable = 0;  // samples whose label is their jittered point's cell
    Eigen::VectorXf p(latent);
    for (std::size_t i = 0; i < n; ++i) {
      for (int k = 0; k < latent; ++k) p[k] = static_cast<float>(2 * rng.uniform() - 1);
      int c = cell_class(p);
      if (rng.uniform() < label_noise) c = rng.below(classes);
      d.y[i] = c;
      for (int k = 0; k < latent; ++k) p[k] += jitter * rng.normal();
      z.col(Eigen::Index(i)) = p;
      knowable += cell_class(p) == c;
    }
    d.ceiling = n ? double(knowable) / double(n) : 0.0;
    const Eigen::MatrixXf h = ((a1 * z).colwise() + b1).array().tanh().matrix();
    d.x.resize(n * dim);
    Eigen::Map<Eigen::MatrixXf> x(d.x.data(), dim, static_cast<Eigen::Index>(n));
    x.noalias() = a2 * h;
    x.colwise() += b2;
    x = x.array().tanh().matrix();
    for (float& v : d.x) v += pixel_noise * rng.noise();
  };
  fill(train, train_samples);
  fill(test, test_samples);
}

/// The built-in data (`train_samples` and `test_samples`, 0: 48,000 and
/// 8,000) or the IDX data `data` chose (its first so many samples, 0: all).
inline void load(Dataset& train, Dataset& test, const DataChoice& data, std::size_t train_samples,
                 std::size_t test_samples, std::uint64_t seed) {
  if (data.synthetic()) {
    synthetic(train, test, train_samples ? train_samples : 48000, test_samples ? test_samples : 8000, seed);
  } else {
    load_idx(train, test, data.dir, train_samples, test_samples);
  }
  if (train.size() == 0 || test.size() == 0) throw std::runtime_error("the training or the test set is empty");
}

/// Copies samples idx[at], ..., idx[at + n - 1] into one contiguous batch.
inline void fill_batch(const Dataset& d, const std::vector<std::size_t>& idx, std::size_t at, int n, float* x,
                       int* y) {
  for (int i = 0; i < n; ++i) {
    std::copy_n(&d.x[idx[at + std::size_t(i)] * std::size_t(d.dim)], d.dim, x + std::size_t(i) * std::size_t(d.dim));
    y[i] = d.y[idx[at + std::size_t(i)]];
  }
}

/// How many of test samples [begin, end) `trainer`'s model classifies right,
/// 256 at a time, forward only.
template <class Trainer>
std::int64_t count_correct(Trainer& trainer, const Dataset& test, std::size_t begin, std::size_t end) {
  std::int64_t correct = 0;
  for (std::size_t i = begin; i < end; i += 256) {
    const int n = static_cast<int>(std::min<std::size_t>(256, end - i));
    const Batch batch{&test.x[i * std::size_t(test.dim)], &test.y[i], n};
    correct += trainer.evaluate([&](const auto& ctx) { return trainer.model().correct(batch, ctx); });
  }
  return correct;
}

}  // namespace example
