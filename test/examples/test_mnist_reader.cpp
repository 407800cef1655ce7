// examples/mnist.hpp reads IDX files written here byte by byte, plain and
// gzip-compressed (by zlib, here), and rejects bad magic numbers, bad
// dimensions, truncated, over-long and corrupt files with an error that
// names the file.
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

#include <zlib.h>

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

  std::string path() const { return path_.string(); }

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

/// `plain` as one gzip member, written by zlib's deflate.
Bytes gzip(const Bytes& plain) {
  z_stream z{};
  REQUIRE(deflateInit2(&z, Z_BEST_SPEED, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  Bytes out(deflateBound(&z, static_cast<uLong>(plain.size())) + 32);
  z.next_in = const_cast<Bytef*>(plain.data());
  z.avail_in = static_cast<uInt>(plain.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  REQUIRE(rc == Z_STREAM_END);
  return out;
}

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

TEST_CASE("gzip-compressed files read as their plain bytes, told by their first bytes, not their names") {
  TempDir dir;
  const Bytes images = images_file(40, 28, 28);
  Bytes labels_plain;
  for (int i = 0; i < 40; ++i) labels_plain.push_back(static_cast<std::uint8_t>(i * 3 % 10));
  const Bytes labels = labels_file(labels_plain);
  const auto plain = example::mnist::read(dir.write("images", images), dir.write("labels", labels));
  const auto gz = example::mnist::read(dir.write("images.gz", gzip(images)), dir.write("labels.gz", gzip(labels)));
  CHECK(gz.images.count == 40);
  CHECK(gz.images.pixels == plain.images.pixels);
  CHECK(gz.labels == plain.labels);
  // A gzip file without .gz, and a plain one with it.
  CHECK(example::mnist::read_images(dir.write("renamed", gzip(images))).pixels == plain.images.pixels);
  CHECK(example::mnist::read_labels(dir.write("plain.gz", labels)) == plain.labels);

  // Two members one after the other (`cat a.gz b.gz`) are one file.
  const Bytes head(images.begin(), images.begin() + 100), tail(images.begin() + 100, images.end());
  Bytes two = gzip(head);
  const Bytes second = gzip(tail);
  two.insert(two.end(), second.begin(), second.end());
  CHECK(example::mnist::read_images(dir.write("two.gz", two)).pixels == plain.images.pixels);
}

TEST_CASE("a directory's files are found plain or with .gz") {
  TempDir dir;
  dir.write("train-images-idx3-ubyte.gz", gzip(images_file(5, 2, 2)));
  dir.write("train-labels-idx1-ubyte", labels_file({0, 1, 2, 3, 4}));
  const auto d = example::mnist::read_split(dir.path(), "train");
  CHECK(d.images.count == 5);
  CHECK(d.labels.size() == 5);
  const std::string missing = error_of([&] { example::mnist::read_split(dir.path(), "t10k"); });
  CHECK(contains(missing, "t10k-images-idx3-ubyte"));
  CHECK(contains(missing, "t10k-images-idx3-ubyte.gz"));
  CHECK(contains(error_of([] { example::mnist::read_split("/nonexistent/gradsync", "train"); }),
                 "/nonexistent/gradsync is not a directory"));
}

TEST_CASE("a file there both plain and as .gz, or a directory in a file's place, is an error naming it") {
  TempDir dir;
  dir.write("train-images-idx3-ubyte", images_file(5, 2, 2));
  dir.write("train-images-idx3-ubyte.gz", gzip(images_file(6, 2, 2)));
  dir.write("train-labels-idx1-ubyte", labels_file({0, 1, 2, 3, 4}));
  const std::string both = error_of([&] { example::mnist::read_split(dir.path(), "train"); });
  CHECK(contains(both, "both "));
  CHECK(contains(both, "train-images-idx3-ubyte.gz"));
  CHECK(contains(both, "keep one of them"));
  fs::create_directory(fs::path(dir.path()) / "t10k-images-idx3-ubyte");
  const std::string not_file = error_of([&] { example::mnist::read_split(dir.path(), "t10k"); });
  CHECK(contains(not_file, "t10k-images-idx3-ubyte is not a regular file"));
}

TEST_CASE("a truncated or corrupt gzip file is an error naming it and what is wrong") {
  TempDir dir;
  const Bytes gz = gzip(images_file(30, 8, 8));
  REQUIRE(gz.size() > 60);

  // Cut in the deflate data, and cut just before the 8-byte trailer (CRC-32 and length).
  const Bytes half(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2));
  const std::string cut = dir.write("half.gz", half);
  const std::string e = error_of([&] { example::mnist::read_images(cut); });
  CHECK(contains(e, cut));
  CHECK(contains(e, "is truncated: its gzip stream ends early"));
  const Bytes no_trailer(gz.begin(), gz.end() - 8);
  CHECK(contains(error_of([&] { example::mnist::read_images(dir.write("nt.gz", no_trailer)); }), "is truncated"));
  // Only the magic bytes.
  CHECK(contains(error_of([&] { example::mnist::read_images(dir.write("m.gz", Bytes{0x1f, 0x8b})); }),
                 "is truncated"));

  // A flipped bit in the CRC-32: zlib checks it against the data.
  Bytes crc = gz;
  crc[crc.size() - 8] ^= 0x01;
  const std::string bad_crc = dir.write("crc.gz", crc);
  const std::string c = error_of([&] { example::mnist::read_images(bad_crc); });
  CHECK(contains(c, bad_crc + " is not a valid gzip file"));
  CHECK(contains(c, "incorrect data check"));

  // A flipped byte inside the deflate data: invalid codes, or else the CRC-32 catches it.
  Bytes flipped = gz;
  flipped[20] ^= 0xff;
  CHECK(contains(error_of([&] { example::mnist::read_images(dir.write("flip.gz", flipped)); }),
                 "is not a valid gzip file"));

  // Bytes after the stream that start no other member.
  Bytes trailing = gz;
  trailing.push_back(0);
  CHECK(contains(error_of([&] { example::mnist::read_images(dir.write("trail.gz", trailing)); }),
                 "1 bytes after the end of its gzip stream"));
}

TEST_CASE("a gzip file's contents are checked as a plain file's are") {
  TempDir dir;
  Bytes im = images_file(3, 4, 5);
  im.pop_back();
  const std::string short_gz = dir.write("short.gz", gzip(im));
  const std::string s = error_of([&] { example::mnist::read_images(short_gz); });
  CHECK(contains(s, short_gz + " is truncated"));
  CHECK(contains(s, "59 bytes after the header"));

  Bytes long_im = images_file(2, 2, 2);
  long_im.push_back(0);
  CHECK(contains(error_of([&] { example::mnist::read_images(dir.write("long.gz", gzip(long_im))); }),
                 "1 bytes more than"));

  const std::string labels_gz = dir.write("labels.gz", gzip(labels_file({1, 2})));
  CHECK(contains(error_of([&] { example::mnist::read_images(labels_gz); }), "this is a labels file"));

  const std::string images_gz = dir.write("images.gz", gzip(images_file(3, 2, 2)));
  CHECK(contains(error_of([&] { example::mnist::read(images_gz, labels_gz); }), "holds 2 labels"));
  const std::string big = dir.write("big.gz", gzip(labels_file({1, 2, 10})));
  const std::string b = error_of([&] { example::mnist::read(images_gz, big); });
  CHECK(contains(b, big));
  CHECK(contains(b, "label 10 at index 2"));
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
