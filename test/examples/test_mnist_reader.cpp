// examples/mnist.hpp reads IDX files written here byte by byte, and rejects
// bad magic numbers, bad dimensions, truncated and gzip-compressed files
// with an error that names the file.
#include <doctest/doctest.h>

#include "mnist.hpp"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::uint8_t>;

/// A fresh directory under the system's temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = fs::temp_directory_path() / ("gradsync_mnist_" + std::to_string(rd()) + std::to_string(rd()));
    fs::create_directory(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }

  std::string write(const std::string& name, const Bytes& bytes) const {
    const fs::path p = path_ / name;
    std::ofstream f(p, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    REQUIRE(f.good());
    return p.string();
  }

 private:
  fs::path path_;
};

void put_be32(Bytes& b, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<std::uint8_t>(v >> shift));
}

/// An IDX3 file of `count` images of rows x cols, pixel k of all of them = k * 7 + image (mod 256).
Bytes images_file(std::uint32_t count, std::uint32_t rows, std::uint32_t cols) {
  Bytes b;
  put_be32(b, 0x00000803);
  put_be32(b, count);
  put_be32(b, rows);
  put_be32(b, cols);
  for (std::uint32_t i = 0; i < count; ++i) {
    for (std::uint32_t k = 0; k < rows * cols; ++k) b.push_back(static_cast<std::uint8_t>(k * 7 + i));
  }
  return b;
}

Bytes labels_file(const Bytes& labels) {
  Bytes b;
  put_be32(b, 0x00000801);
  put_be32(b, static_cast<std::uint32_t>(labels.size()));
  b.insert(b.end(), labels.begin(), labels.end());
  return b;
}

/// The message of what `f` throws, or "" if it does not.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("images and labels written here read back with big-endian dimensions") {
  TempDir dir;
  // 300 images makes the count's second byte nonzero: a little-endian reader would see 0x2c010000.
  const std::string images = dir.write("images-idx3-ubyte", images_file(300, 3, 2));
  Bytes want_labels;
  for (int i = 0; i < 300; ++i) want_labels.push_back(static_cast<std::uint8_t>(i % 10));
  const std::string labels = dir.write("labels-idx1-ubyte", labels_file(want_labels));

  const auto im = example::mnist::read_images(images);
  CHECK(im.count == 300);
  CHECK(im.rows == 3);
  CHECK(im.cols == 2);
  REQUIRE(im.pixels.size() == 300 * 6);
  CHECK(im.pixels[0] == 0);
  CHECK(im.pixels[5] == 35);
  CHECK(im.pixels[6 * 299 + 1] == static_cast<std::uint8_t>(7 + 299));
  CHECK(example::mnist::read_labels(labels) == want_labels);

  const auto both = example::mnist::read(images, labels);
  CHECK(both.images.count == 300);
  CHECK(both.labels == want_labels);
}

TEST_CASE("an empty set reads as zero images") {
  TempDir dir;
  const auto im = example::mnist::read_images(dir.write("i", images_file(0, 28, 28)));
  CHECK(im.count == 0);
  CHECK(im.rows == 28);
  CHECK(im.pixels.empty());
}

TEST_CASE("a wrong magic number is an error naming the file, both numbers, and a swapped pair") {
  TempDir dir;
  const std::string images = dir.write("images", images_file(2, 2, 2));
  const std::string labels = dir.write("labels", labels_file({1, 2}));

  const std::string swapped = error_of([&] { example::mnist::read_images(labels); });
  CHECK(contains(swapped, labels));
  CHECK(contains(swapped, "0x00000801"));
  CHECK(contains(swapped, "expected 0x00000803"));
  CHECK(contains(swapped, "this is a labels file"));
  CHECK(contains(error_of([&] { example::mnist::read_labels(images); }), "this is an images file"));

  Bytes bad = images_file(2, 2, 2);
  bad[2] = 0x09;  // 0x00000903: a wrong data type
  const std::string e = error_of([&] { example::mnist::read_images(dir.write("bad", bad)); });
  CHECK(contains(e, "magic number 0x00000903"));

  // Little-endian magic: a file written by a reader that got it wrong.
  Bytes le = images_file(2, 2, 2);
  std::swap(le[0], le[3]);
  std::swap(le[1], le[2]);
  CHECK(contains(error_of([&] { example::mnist::read_images(dir.write("le", le)); }), "0x03080000"));
}

TEST_CASE("gzip-compressed files are recognised and the fix named") {
  TempDir dir;
  const std::string gz = dir.write("images.gz", Bytes{0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});
  CHECK(contains(error_of([&] { example::mnist::read_images(gz); }), "gunzip it first"));
}

TEST_CASE("truncated files are errors that say how many bytes were expected and found") {
  TempDir dir;
  Bytes im = images_file(3, 4, 5);
  im.pop_back();
  const std::string short_images = error_of([&] { example::mnist::read_images(dir.write("images", im)); });
  CHECK(contains(short_images, "is truncated"));
  CHECK(contains(short_images, "3 images of 4 x 5 (60 bytes)"));
  CHECK(contains(short_images, "59 bytes after the header"));

  Bytes lb = labels_file({1, 2, 3});
  lb.resize(lb.size() - 2);
  CHECK(contains(error_of([&] { example::mnist::read_labels(dir.write("labels", lb)); }), "is truncated"));

  // Cut inside the header itself.
  const std::string header = error_of([&] { example::mnist::read_images(dir.write("h", Bytes{0, 0, 8, 3, 0, 0})); });
  CHECK(contains(header, "6 bytes, less than its 16-byte IDX header"));
  CHECK(contains(error_of([&] { example::mnist::read_labels(dir.write("empty", {})); }), "is truncated"));
}

TEST_CASE("extra bytes, zero-sized images, mismatched counts and labels above 9 are errors") {
  TempDir dir;
  Bytes im = images_file(2, 2, 2);
  im.push_back(0);
  CHECK(contains(error_of([&] { example::mnist::read_images(dir.write("long", im)); }), "1 bytes more than"));
  CHECK(contains(error_of([&] { example::mnist::read_images(dir.write("zero", images_file(1, 0, 5))); }),
                 "images of 0 x 5 pixels"));

  const std::string images = dir.write("images", images_file(3, 2, 2));
  const std::string two = dir.write("two", labels_file({1, 2}));
  const std::string counts = error_of([&] { example::mnist::read(images, two); });
  CHECK(contains(counts, "holds 3 images"));
  CHECK(contains(counts, "holds 2 labels"));
  const std::string big = dir.write("big", labels_file({1, 12, 3}));
  CHECK(contains(error_of([&] { example::mnist::read(images, big); }), "label 12 at index 1"));
}

TEST_CASE("a missing file is an error naming it") {
  CHECK(contains(error_of([] { example::mnist::read_images("/nonexistent/gradsync/images"); }),
                 "cannot open /nonexistent/gradsync/images"));
}
