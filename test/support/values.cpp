// The shared test helpers of values.hpp, compiled once per build.
#include "support/values.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "gradsync/core/visit.hpp"

namespace gs = gradsync;

namespace test {

namespace {

template <class T>
double to_double(T x) {
  if constexpr (gs::detail::is_half_storage_v<T>) {
    return static_cast<double>(static_cast<float>(x));
  } else {
    return static_cast<double>(x);
  }
}

template <class T>
T from_double(double x) {
  if constexpr (std::is_integral_v<T> || std::is_same_v<T, double>) {
    return static_cast<T>(x);
  } else {
    return T(static_cast<float>(x));
  }
}

std::size_t element_size(gs::DataType t) {
  return gs::visit(t, []<class T>(T) { return sizeof(T); });
}

/// Relative error of one rounding step (0 for integers).
double step_eps(gs::DataType t) {
  return gs::visit(t, []<class T>(T) -> double {
    if constexpr (std::is_same_v<T, gs::bfloat16>) {
      return 1.0 / 256.0;
    } else if constexpr (std::is_same_v<T, gs::float16>) {
      return 1.0 / 2048.0;
    } else if constexpr (std::is_floating_point_v<T>) {
      return static_cast<double>(std::numeric_limits<T>::epsilon());
    } else {
      return 0.0;
    }
  });
}

bool is_integer(gs::DataType t) { return t == gs::DataType::int32 || t == gs::DataType::int64; }

template <class T>
T draw_one(std::mt19937_64& g, Draw how) {
  if constexpr (std::is_integral_v<T>) {
    if (how == Draw::factors) {
      static constexpr T values[] = {1, 1, 2, 2, -1};
      return values[std::uniform_int_distribution<int>(0, 4)(g)];
    }
    return static_cast<T>(std::uniform_int_distribution<int>(-1000, 1000)(g));
  } else {
    double v = 0;
    if (how == Draw::factors) {
      v = std::uniform_real_distribution<double>(0.5, 1.5)(g);
      if (std::uniform_int_distribution<int>(0, 3)(g) == 0) v = -v;
    } else if (how == Draw::wide) {
      const double u = std::uniform_real_distribution<double>(1.0, 2.0)(g);
      constexpr int decades = std::is_same_v<T, gs::float16> ? 3 : 6;
      const int k = std::uniform_int_distribution<int>(-decades, decades)(g);
      const double s = std::uniform_int_distribution<int>(0, 1)(g) ? -1.0 : 1.0;
      v = static_cast<float>(s * u * std::pow(10.0, k));
    } else {
      v = std::uniform_real_distribution<double>(-1.0, 1.0)(g);
    }
    return from_double<T>(v);
  }
}

}  // namespace

Values::Values(gs::DataType type, std::size_t count)
    : type_(type), count_(count), storage_((count * element_size(type) + 7) / 8) {}

std::size_t Values::size_bytes() const { return count_ * element_size(type_); }

double Values::at(std::size_t i) const {
  return gs::visit(type_, [&]<class T>(T) { return to_double(as<T>()[i]); });
}

void Values::fill(double x) {
  gs::visit(type_, [&]<class T>(T) { std::fill_n(as<T>().data(), count_, from_double<T>(x)); });
}

Values Values::slice(std::size_t first, std::size_t count) const {
  Values v(type_, count);
  const std::size_t e = element_size(type_);
  if (count) std::memcpy(v.data(), static_cast<const std::byte*>(data()) + first * e, count * e);
  return v;
}

void Values::put(std::size_t first, const Values& v) {
  const std::size_t e = element_size(type_);
  if (v.size()) std::memcpy(static_cast<std::byte*>(data()) + first * e, v.data(), v.size() * e);
}

std::vector<Values> draw_inputs(std::mt19937_64& g, gs::DataType type, int n, std::size_t count, Draw how) {
  std::vector<Values> in(static_cast<std::size_t>(n), Values(type, count));
  gs::visit(type, [&]<class T>(T) {
    for (auto& v : in)
      for (T& x : v.as<T>()) x = draw_one<T>(g, how);
  });
  return in;
}

std::vector<Expect> reference(const std::vector<Values>& in, gs::OpKind op) {
  using K = gs::OpKind;
  const std::size_t count = in.empty() ? 0 : in[0].size();
  const gs::DataType type = in.empty() ? gs::DataType::float32 : in[0].type();
  const auto n = static_cast<double>(in.size());
  std::vector<Expect> want(count);
  for (std::size_t i = 0; i < count; ++i) {
    if (is_integer(type)) {
      // Exact in int64 (the inputs are small); C++ division truncates toward
      // zero, as Avg promises.
      auto acc = static_cast<std::int64_t>(in[0].at(i));
      for (std::size_t q = 1; q < in.size(); ++q) {
        const auto x = static_cast<std::int64_t>(in[q].at(i));
        if (op == K::sum || op == K::avg) acc += x;
        if (op == K::min) acc = std::min(acc, x);
        if (op == K::max) acc = std::max(acc, x);
        if (op == K::prod) acc *= x;
      }
      if (op == K::avg) acc /= static_cast<std::int64_t>(in.size());
      want[i] = {static_cast<double>(acc), 0.0};
    } else {
      // N roundings, each at most eps relative to the partial result.
      const double eps = step_eps(type);
      double acc = in[0].at(i);
      double abs_sum = std::fabs(acc);
      for (std::size_t q = 1; q < in.size(); ++q) {
        const double x = in[q].at(i);
        abs_sum += std::fabs(x);
        if (op == K::sum || op == K::avg) acc += x;
        if (op == K::min) acc = std::min(acc, x);
        if (op == K::max) acc = std::max(acc, x);
        if (op == K::prod) acc *= x;
      }
      double tol = 0;
      if (op == K::sum) tol = 4 * n * eps * abs_sum;
      if (op == K::avg) {
        acc /= n;
        tol = 4 * eps * abs_sum + 2 * eps * std::fabs(acc);
      }
      if (op == K::prod) tol = 4 * n * eps * std::fabs(acc);
      want[i] = {acc, tol};
    }
  }
  return want;
}

void check_close(const Values& got, std::span<const Expect> want, const std::string& where) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double v = got.at(i);
    if (!(std::fabs(v - want[i].ref) <= want[i].tol)) {
      FAIL_CHECK(where << ": element " << i << " of " << got.size() << " is " << v << ", expected " << want[i].ref
                       << " +- " << want[i].tol);
      return;
    }
  }
}

bool same_bits(const Values& a, const Values& b) {
  return a.type() == b.type() && a.size() == b.size() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}

void check_bits(const Values& got, const Values& want, const std::string& where) {
  REQUIRE(got.type() == want.type());
  REQUIRE(got.size() == want.size());
  const std::size_t e = element_size(got.type());
  const auto* a = static_cast<const std::byte*>(got.data());
  const auto* b = static_cast<const std::byte*>(want.data());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(a + i * e, b + i * e, e) != 0) {
      FAIL_CHECK(where << ": element " << i << " of " << got.size() << " is " << got.at(i) << ", expected "
                       << want.at(i));
      return;
    }
  }
}

}  // namespace test
