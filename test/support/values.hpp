#pragma once
// Test data of a run-time element type, and the checks every suite shares.
// The helpers are compiled once (support/values.cpp), whatever the types a
// suite runs: a test body makes the typed call and hands its buffers here.

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gradsync/core/ops.hpp"
#include "gradsync/core/types.hpp"

namespace test {

/// One rank's buffer: `size()` elements of `type()`.
class Values {
 public:
  Values() = default;
  Values(gradsync::DataType type, std::size_t count);

  gradsync::DataType type() const { return type_; }
  std::size_t size() const { return count_; }
  std::size_t size_bytes() const;
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }

  /// Element i, converted to double (exact for every element type here).
  double at(std::size_t i) const;
  /// Sets every element to x, converted to the element type.
  void fill(double x);
  /// Elements [first, first + count) as a buffer of their own.
  Values slice(std::size_t first, std::size_t count) const;
  /// Copies v's elements to [first, first + v.size()).
  void put(std::size_t first, const Values& v);

  template <class T>
  std::span<T> as() {
    return {static_cast<T*>(data()), count_};
  }
  template <class T>
  std::span<const T> as() const {
    return {static_cast<const T*>(data()), count_};
  }

 private:
  gradsync::DataType type_ = gradsync::DataType::float32;
  std::size_t count_ = 0;
  // uint64_t storage: aligned for every element type.
  std::vector<std::uint64_t> storage_;
};

/// How inputs are drawn. `small`: integers in [-1000, 1000] (sums exact),
/// floats in [-1, 1]. `factors`: integers from {1, 2, -1}, floats of
/// magnitude [0.5, 1.5], so a product over nine ranks stays exact or finite.
/// `wide`: +-u * 10^k, u in [1, 2), k in [-6, 6] ([-3, 3] for float16), so
/// that any order of a sum but one changes the bits.
enum class Draw { small, factors, wide };

/// inputs[r] for each of n ranks, `count` elements each.
std::vector<Values> draw_inputs(std::mt19937_64& g, gradsync::DataType type, int n, std::size_t count,
                                Draw how = Draw::small);

/// What one output element must be: within `tol` of `ref` (tol 0: exact).
struct Expect {
  double ref = 0;
  double tol = 0;
};

/// Element-wise reference of `op` over the ranks' inputs: exact in int64 for
/// integers, in double for floats with a tolerance that grows with N.
std::vector<Expect> reference(const std::vector<Values>& in, gradsync::OpKind op);

/// Fails the current case at the first element of `got` that misses `want`.
void check_close(const Values& got, std::span<const Expect> want, const std::string& where);

/// Whether a and b hold the same type, count and bits.
bool same_bits(const Values& a, const Values& b);
/// Fails the current case at the first element whose bits differ.
void check_bits(const Values& got, const Values& want, const std::string& where);

}  // namespace test
