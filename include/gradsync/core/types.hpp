#pragma once
/// \file The element types a collective accepts, and their names.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string_view>
#include <type_traits>

#include "gradsync/core/bfloat16.hpp"
#include "gradsync/core/float16.hpp"

namespace gradsync {

/// Element types gradsync reduces. Each has a stable id, so ranks can check
/// that they agree before touching each other's memory.
enum class DataType : std::uint8_t { float32, float64, int32, int64, bfloat16, float16 };

template <class T>
struct DataTypeOf;
template <>
struct DataTypeOf<float> : std::integral_constant<DataType, DataType::float32> {};
template <>
struct DataTypeOf<double> : std::integral_constant<DataType, DataType::float64> {};
template <>
struct DataTypeOf<std::int32_t> : std::integral_constant<DataType, DataType::int32> {};
template <>
struct DataTypeOf<std::int64_t> : std::integral_constant<DataType, DataType::int64> {};
template <>
struct DataTypeOf<bfloat16> : std::integral_constant<DataType, DataType::bfloat16> {};
template <>
struct DataTypeOf<float16> : std::integral_constant<DataType, DataType::float16> {};

namespace detail {
/// 16-bit float storage types: reduced in float, rounded back at each step.
template <class T>
inline constexpr bool is_half_storage_v = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;
}  // namespace detail

/// A type gradsync can carry and reduce: float, double, int32, int64, bfloat16, float16.
template <class T>
concept Element = requires { DataTypeOf<std::remove_cv_t<T>>::value; };

template <Element T>
inline constexpr DataType data_type_v = DataTypeOf<std::remove_cv_t<T>>::value;

/// Names as diagnostics and benchmark columns spell them, indexed by DataType.
inline constexpr std::string_view data_type_names[] = {"float", "double", "int32", "int64", "bfloat16", "float16"};

constexpr std::string_view name(DataType t) noexcept {
  const auto i = static_cast<std::size_t>(t);
  return i < std::size(data_type_names) ? data_type_names[i] : "?";
}

}  // namespace gradsync
