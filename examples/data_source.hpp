#pragma once
// Which data an example trains on, and data in MNIST's layout of IDX files
// as float features. --data DIR (or --mnist DIR) reads DIR; --dataset
// fashion-mnist reads Debian's dataset-fashion-mnist; --dataset synthetic is
// the built-in data; with none of them, Fashion-MNIST where it is installed
// and the built-in data otherwise. The standard library, zlib and gradsync's
// CRC-32 only, so that libtorch_ddp (no Eigen) shares it with the Eigen examples.

#include "mnist.hpp"

#include <gradsync/checkpoint/crc32.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace example {

/// Where Debian's dataset-fashion-mnist puts its four .gz files.
inline constexpr const char* fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";

/// Samples as float features: sample i at x[i * dim], its class y[i].
struct Dataset {
  int dim = 0, classes = 0;
  std::vector<float> x;
  std::vector<int> y;
  double ceiling = 0;  // best test accuracy possible, where known
  std::size_t size() const { return y.size(); }
};

/// The data a run trains on: IDX files in `dir`, or the built-in data where `dir` is empty.
struct DataChoice {
  std::string dir;
  /// As the programs print it: "Fashion-MNIST", "IDX data from DIR" or "synthetic data".
  std::string name;
  /// Why this data, when no option chose it; else "".
  std::string note;
  bool synthetic() const { return dir.empty(); }
  /// What a checkpoint records of the data, so that a run resumed on other
  /// data is refused: the built-in data with its seed, or the directory.
  std::string identity(std::uint64_t seed) const {
    if (synthetic()) return "synthetic data, --seed " + std::to_string(seed);
    std::error_code ec;
    const std::filesystem::path p = std::filesystem::weakly_canonical(dir, ec);
    return "IDX data from " + (ec ? dir : p.string());
  }
  bool fashion_mnist() const { return name == "Fashion-MNIST"; }
};

/// What a checkpoint records of the training data's values beside
/// DataChoice::identity(): a directory may hold other files by the time a
/// run resumes from it. The sample count and one CRC-32 of the features'
/// bytes and then the classes'.
inline std::string content_checksum(std::span<const std::byte> features, std::span<const std::byte> classes,
                                    std::size_t samples) {
  gradsync::checkpoint::Crc32 crc;
  crc.update(features);
  crc.update(classes);
  return std::to_string(samples) + " samples, CRC-32 " + gradsync::checkpoint::crc32_hex(crc.value());
}

inline std::string content_checksum(const Dataset& d) {
  return content_checksum(std::as_bytes(std::span<const float>(d.x)), std::as_bytes(std::span<const int>(d.y)),
                          d.size());
}

namespace detail {

/// Whether `dir` holds the training split in MNIST's layout, plain or .gz.
inline bool has_idx_data(const std::string& dir) {
  try {
    mnist::find(dir, "train-images-idx3-ubyte");
    return true;
  } catch (const std::runtime_error&) {
    return false;
  }
}

/// Whether `a` and `b` name the same directory (false when either is missing).
inline bool same_dir(const std::string& a, const std::string& b) {
  std::error_code ec;
  const bool same = std::filesystem::equivalent(a, b, ec);
  return !ec && same;
}

}  // namespace detail

/// Resolves --data DIR (`data_dir`) and --dataset NAME (`dataset`; at most
/// one of the two given). Data in Debian's Fashion-MNIST directory is named
/// so, wherever it was given; other IDX data by its directory, since its
/// files do not say whether they hold digits or clothes.
inline DataChoice choose_data(const std::string& data_dir, const std::string& dataset) {
  if (!data_dir.empty() && !dataset.empty()) {
    throw std::runtime_error("--data (or --mnist) and --dataset both choose the data: give one of them");
  }
  auto from_dir = [](const std::string& dir, std::string note) {
    const bool fashion = detail::same_dir(dir, fashion_mnist_dir);
    return DataChoice{dir, fashion ? "Fashion-MNIST" : "IDX data from " + dir, std::move(note)};
  };
  if (!data_dir.empty()) return from_dir(data_dir, "");
  if (dataset == "synthetic") return {"", "synthetic data", ""};
  if (dataset == "fashion-mnist") {
    if (!detail::has_idx_data(fashion_mnist_dir)) {
      throw std::runtime_error(std::string("--dataset fashion-mnist: no Fashion-MNIST in ") + fashion_mnist_dir +
                               "; install it (apt-get install dataset-fashion-mnist), or give --data DIR");
    }
    return from_dir(fashion_mnist_dir, "");
  }
  if (!dataset.empty()) {
    throw std::runtime_error("unknown --dataset '" + dataset + "' (expected fashion-mnist or synthetic)");
  }
  if (detail::has_idx_data(fashion_mnist_dir)) {
    return from_dir(fashion_mnist_dir, std::string("found in ") + fashion_mnist_dir +
                                           "; --dataset synthetic for the built-in data");
  }
  return {"", "synthetic data",
          "Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist, or --data DIR for MNIST's files)"};
}

/// Pixel values standardised to mean 0 and variance 1 over the training set.
struct PixelScale {
  double mean = 0, stddev = 1;
};

/// The mean and standard deviation of every pixel of `pixels` (in 0..1):
/// from their histogram, so 47 million pixels cost one pass of counting.
inline PixelScale pixel_scale(const std::vector<std::uint8_t>& pixels) {
  std::vector<std::uint64_t> count(256, 0);
  for (const std::uint8_t p : pixels) ++count[p];
  double n = 0, sum = 0, squares = 0;
  for (int v = 0; v < 256; ++v) {
    const double c = double(count[std::size_t(v)]), x = v / 255.0;
    n += c;
    sum += c * x;
    squares += c * x * x;
  }
  if (n == 0) return {};
  const double mean = sum / n, var = squares / n - mean * mean;
  return {mean, var > 1e-12 ? std::sqrt(var) : 1.0};
}

/// One split as float features, standardised by `scale`.
inline Dataset to_dataset(const mnist::LabelledImages& m, const PixelScale& scale) {
  Dataset d;
  d.dim = static_cast<int>(m.images.rows * m.images.cols);
  d.classes = 10;
  d.x.resize(m.images.pixels.size());
  const float mean = static_cast<float>(scale.mean), inv = static_cast<float>(1.0 / scale.stddev);
  for (std::size_t i = 0; i < d.x.size(); ++i) d.x[i] = (m.images.pixels[i] / 255.0f - mean) * inv;
  d.y.assign(m.labels.begin(), m.labels.end());
  return d;
}

/// Keeps the first `n` samples (all when n is 0 or more than there are).
inline void truncate(Dataset& d, std::size_t n) {
  if (n == 0 || n >= d.size()) return;
  d.x.resize(n * std::size_t(d.dim));
  d.y.resize(n);
}

/// The train and t10k splits of the IDX data in `dir`, their first so many
/// samples (0: all). Pixels are standardised by the whole training set's
/// mean and deviation (Fashion-MNIST's 0.286 and 0.353, MNIST's 0.131 and
/// 0.308), test pixels by the same: unit-scale inputs keep the first
/// layer's gradients at the size the learning rate was chosen for.
inline PixelScale load_idx(Dataset& train, Dataset& test, const std::string& dir, std::size_t train_samples,
                           std::size_t test_samples) {
  const mnist::LabelledImages tr = mnist::read_split(dir, "train"), te = mnist::read_split(dir, "t10k");
  if (tr.images.rows != te.images.rows || tr.images.cols != te.images.cols) {
    throw std::runtime_error(dir + ": training images are " + std::to_string(tr.images.rows) + " x " +
                             std::to_string(tr.images.cols) + ", test images " + std::to_string(te.images.rows) +
                             " x " + std::to_string(te.images.cols));
  }
  const PixelScale scale = pixel_scale(tr.images.pixels);
  train = to_dataset(tr, scale);
  test = to_dataset(te, scale);
  truncate(train, train_samples);
  truncate(test, test_samples);
  return scale;
}

}  // namespace example
